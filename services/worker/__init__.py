"""What prefill and decode workers share: configuration, the scheduler link, token streams."""
