"""What the tests share: loopback servers, a running exporter, page-cache files, a fake NVML."""
