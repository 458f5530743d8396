"""A stage's state: its modules and optimizers (``stage_state``), the weight versions (``versions``), the batches in
flight (``ledger``) and what it holds (``counters``)."""
