"""The running exporter: wiring config, sources, sampler, trackers and history together.

wiring.py builds each target's sources, ticks its tracker and hands out snapshots; reactions.py
answers readings between ticks (tick now, measure now, an exit, a clock step, a hung server);
filing.py files finished loads and keeps what history says of each target; admission.py says
which targets there are; target.py is what is held for one between ticks; sampler.py runs each
source on its own thread and pacing.py says how often; observe.py turns a target's latest
readings into the tracker's observation; logfollow.py says which log a target follows;
exitwatch.py sees a watched process exit; snapshot.py is the immutable view a scrape reads.
"""
