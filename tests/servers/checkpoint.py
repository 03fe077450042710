"""A random-weight Llama checkpoint in Hugging Face layout: the model the real-server tests load.

No model hub is reachable here, so the tests make their own: `LlamaForCausalLM`, 1.34 GB of bf16
in 4 safetensors shards with HF tensor names and `model.safetensors.index.json`, and a word-level
tokenizer. Weights are normal * 0.02 and the norms 1: random but small enough that a forward pass
stays finite (larger values overflow to NaN within a few layers).

The shape is a big vocabulary on two thin layers: vLLM's start-up profiles 2048 tokens through the
layers (and 128 through the LM head), and bf16 matmuls on a CPU without AVX-512 run at about
9 GFLOP/s on the one core vLLM keeps, so 12 layers of 2048 (the same bytes) took 225 s there and
this shape about 20 s. The bytes sit where loading them costs the same: in the embedding and the
LM head, cut into shards the way `save_pretrained(max_shard_size=...)` cuts them.

Two halves, because the project's venv has no torch: `ensure(directory, python)` runs in the
project's venv and, when no complete checkpoint is there, runs this file under `python` (the vLLM
venv's), whose torch, safetensors and tokenizers write it into a scratch folder that is renamed
into place when complete. So a folder that exists is complete, and it is reused.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HIDDEN = 1024
INTERMEDIATE = 2816
LAYERS = 2
HEADS = 8
KV_HEADS = 4
VOCAB = 316416
MAX_SHARD_BYTES = 25_000_000  # embedding | layer 0 | layer 1 and the norm | LM head
SEED = 20251201
NAME = f"llama-h{HIDDEN}-l{LAYERS}-v{VOCAB}-bf16"

SPECIALS = ("[UNK]", "<s>", "</s>")
# Real words first, so a prompt of them needs no [UNK]; the rest of the vocabulary is w<N>.
WORDS = (
    "the of and to in is it that was for on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know hello world model "
    "load weights cache server ready"
)
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": SPECIALS.index("<s>"),
    "eos_token_id": SPECIALS.index("</s>"),
    "torch_dtype": "bfloat16",
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "[UNK]",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "model_max_length": 512,
    "clean_up_tokenization_spaces": False,
}


Shapes = list[tuple[str, tuple[int, ...]]]


def tensor_shapes() -> Shapes:
    """Every tensor of the model with its HF name, in the order HF writes them."""
    head_dim = HIDDEN // HEADS
    layer = [
        ("input_layernorm.weight", (HIDDEN,)),
        ("self_attn.q_proj.weight", (HEADS * head_dim, HIDDEN)),
        ("self_attn.k_proj.weight", (KV_HEADS * head_dim, HIDDEN)),
        ("self_attn.v_proj.weight", (KV_HEADS * head_dim, HIDDEN)),
        ("self_attn.o_proj.weight", (HIDDEN, HEADS * head_dim)),
        ("post_attention_layernorm.weight", (HIDDEN,)),
        ("mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
        ("mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
        ("mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
    ]
    return [
        ("model.embed_tokens.weight", (VOCAB, HIDDEN)),
        *((f"model.layers.{i}.{name}", shape) for i in range(LAYERS) for name, shape in layer),
        ("model.norm.weight", (HIDDEN,)),
        ("lm_head.weight", (VOCAB, HIDDEN)),
    ]


def shard_plan() -> list[Shapes]:
    """HF's cut: tensors in order, a new shard when the next one would pass MAX_SHARD_BYTES."""
    plan: list[Shapes] = [[]]
    size = 0
    for name, shape in tensor_shapes():
        nbytes = 2 * math.prod(shape)  # bf16
        if plan[-1] and size + nbytes > MAX_SHARD_BYTES:
            plan.append([])
            size = 0
        plan[-1].append((name, shape))
        size += nbytes
    return plan


PLAN = shard_plan()


def shard_name(index: int) -> str:
    return f"model-{index + 1:05d}-of-{len(PLAN):05d}.safetensors"


FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
    *(shard_name(i) for i in range(len(PLAN))),
)


def ensure(root: Path, python: str) -> Path:
    """The checkpoint under `root` (a cache folder), written with `python` when not there yet."""
    directory = root / NAME
    if all((directory / name).is_file() for name in FILES):
        return directory
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(directory, ignore_errors=True)  # files missing: not one this function renamed
    scratch = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
    scratch.chmod(0o755)  # mkdtemp's 0700 would hide the model from tests run as another user
    try:
        subprocess.run([python, __file__, str(scratch)], check=True, timeout=600)
        scratch.rename(directory)
    except OSError:
        if not directory.is_dir():  # another test run renamed its own first: that one is used
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def write(directory: Path) -> None:
    """Write the whole checkpoint into `directory` (under the vLLM venv's python)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    generator = torch.Generator().manual_seed(SEED)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for index, tensors in enumerate(PLAN):
        data = {}
        for name, shape in tensors:
            if len(shape) == 1:  # RMSNorm scales
                value = torch.ones(shape, dtype=torch.bfloat16)
            else:
                value = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            data[name] = value
            weight_map[name] = shard_name(index)
            total_bytes += value.numel() * value.element_size()
        save_file(data, str(directory / shard_name(index)), metadata={"format": "pt"})
    index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))

    fillers = (f"w{i}" for i in range(VOCAB))
    words = [*SPECIALS, *WORDS.split(), *fillers][:VOCAB]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    for path in directory.iterdir():
        path.chmod(0o644)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
