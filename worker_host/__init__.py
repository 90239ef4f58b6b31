"""The worker process: one loaded engine hosting a prefill or a decode role, switchable between them."""
