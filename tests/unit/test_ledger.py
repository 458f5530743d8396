"""The per-batch ledger: a 2BW run's entries open and close in the schedule's order, what is held is counted, and
it cannot grow: a batch never consumed makes the next opening (or the drain) fail loudly."""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.engine.state.ledger import LIMIT, BatchLedger


class Done:
    def wait(self) -> None:
        pass


def test_a_2bw_run_holds_at_most_three_batches():
    """Step s: the head of step s completes the update of s - 2 (STEP(s - 2) takes its hyper-parameters), then
    s opens; s - 1's loss is taken one step later (as the strategy runs them)."""
    ledger, held = BatchLedger(), []
    hparams = [[{"lr": 0.1}]]
    for step in range(6):
        if ledger.next_batch >= 2:  # CHECK .. STEP(s - 2) at the head of step s
            assert ledger.take_hparams(ledger.next_batch - 2) == hparams
        batch = ledger.open(global_step=10 + step, hparams=hparams)
        assert batch == step and ledger.global_step(batch) == 10 + step
        ledger.put_loss(batch, torch.tensor(float(step)), Done())
        if batch >= 1:
            assert ledger.take_loss(batch - 1) == step - 1
        held.append(ledger.counters())
    assert max(c["batches"] for c in held) <= 3
    assert held[-1] == {"batches": 2, "updates_pending": 2, "losses_in_flight": 1} | {
        "loss_sums": 0,
        "skipped_pending": 0,
    }
    with pytest.raises(RuntimeError, match="still hold an update or a loss after a drain"):
        ledger.restart()  # the drain's own updates and loss were not consumed


def test_an_entry_never_consumed_fails_instead_of_growing():
    ledger = BatchLedger()
    for step in range(LIMIT):
        ledger.open(step, [[]])
    with pytest.raises(RuntimeError, match=f"{LIMIT} batches still held .* when opening batch {LIMIT}"):
        ledger.open(LIMIT, [[]])


def test_a_drained_ledger_restarts_its_numbering():
    ledger = BatchLedger()
    batch = ledger.open(7, [[]])
    ledger.take_hparams(batch)
    ledger.put_loss(batch, torch.tensor(1.0), Done())
    assert ledger.pending_losses() == [0] and ledger.take_loss(0) == 1.0
    assert ledger.counters()["batches"] == 0 and ledger.global_step(0) == -1  # closed once consumed
    ledger.restart()
    assert ledger.open(8, [[]]) == 0


def test_the_stages_work_in_flight_is_per_batch_state_of_the_ledger():
    """The last stage's loss sums and the skipped batches live in the ledger and leave it as their batch is done with
    them; a drain that finds a loss sum left refuses (a batch's last backward is the lowering's: ``Op.last``)."""
    ledger = BatchLedger()
    for microbatch in range(3):
        ledger.add_loss(0, torch.tensor(float(microbatch + 1)))
    assert ledger.counters()["loss_sums"] == 1
    assert ledger.take_loss_sum(0).item() == 6.0 and ledger.counters()["loss_sums"] == 0
    ledger.skip(1)
    assert ledger.is_skipped(1) and ledger.take_skip(1) and not ledger.take_skip(1)
    ledger.add_loss(2, torch.tensor(1.0))
    with pytest.raises(RuntimeError, match=r"losses of batches \[2\] are still held after a drain"):
        ledger.restart()
