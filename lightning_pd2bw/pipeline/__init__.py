"""The pipeline engine: plain PyTorch, no Lightning. Schedules are data; one executor runs them."""
