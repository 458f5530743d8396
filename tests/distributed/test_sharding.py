"""The optimizer sharded over a stage's replicas (ZeRO-1, ``engine/updates/sharding.py``) is exactly the unsharded run, and
holds about 1/w of the optimizer's state and the correction's buffers (``run_sharding.py``: depth 2 x width 2,
2BW, AdamW, the predictive correction, global clipping). The unsharded run is itself held to single-device
training by ``test_equivalence.py``, whose width-2 and width-4 cases run sharded (the default)."""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.engine.updates.sharding import assign_owners

from .launch import ROOT, torchrun_script

pytestmark = pytest.mark.smoke
WIDTH, DEPTH = 2, 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("sharding")
    torchrun_script(ROOT / "tests" / "distributed" / "run_sharding.py", [str(out)], WIDTH * DEPTH, timeout=300)
    return {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WIDTH * DEPTH)}


def test_sharded_training_is_the_unsharded_rule_exactly(results):
    for rank, result in results.items():
        sharded, whole = result["sharded"]["weights"], result["whole"]["weights"]
        assert set(sharded) == set(whole) and sharded
        for name, value in whole.items():
            torch.testing.assert_close(sharded[name], value, rtol=0, atol=0, msg=f"rank {rank}: {name}")


def test_every_replica_holds_the_same_weights(results):
    for stage in range(DEPTH):
        first = results[stage]["sharded"]["weights"]
        for replica in range(1, WIDTH):
            other = results[replica * DEPTH + stage]["sharded"]["weights"]
            for name, value in first.items():
                assert torch.equal(other[name], value), f"stage {stage}, replica {replica}: {name}"


def test_each_parameter_is_stepped_by_one_replica(results):
    for stage in range(DEPTH):
        ranks = [replica * DEPTH + stage for replica in range(WIDTH)]
        owned = [set(results[r]["sharded"]["stepped"]) for r in ranks]
        every = set(results[ranks[0]]["whole"]["stepped"])
        assert set().union(*owned) == every and sum(map(len, owned)) == len(every), f"stage {stage}"
        assert all(owned), f"stage {stage}: every replica owns a share"


def test_optimizer_and_correction_memory_are_sharded(results):
    """Each replica holds its share's AdamW moments and correction buffers: together what one unsharded replica
    held, each at most half of it plus the largest tensor (ownership is by whole tensors); the planner's terms are
    the share's."""
    for stage in range(DEPTH):
        ranks = [replica * DEPTH + stage for replica in range(WIDTH)]
        whole = results[ranks[0]]["whole"]["counters"]
        largest = max(n for _, n in results[ranks[0]]["whole"]["params"]) * 4
        for key in ("optimizer_state_bytes", "correction_bytes"):
            shares = [results[r]["sharded"]["counters"][key] for r in ranks]
            assert whole[key] > 0
            steps = 4 * len(results[ranks[0]]["whole"]["stepped"])  # AdamW's per-tensor step counters
            assert abs(sum(shares) - whole[key]) <= (steps if key == "optimizer_state_bytes" else 0), key
            buffers = 2 if key == "optimizer_state_bytes" else 2  # AdamW's moments; D(t-1) and D(t-2)
            assert all(share <= whole[key] / WIDTH + buffers * largest + steps for share in shares), (key, shares)
        plan, unsharded = results[ranks[0]]["sharded"]["plan"], results[ranks[0]]["whole"]["plan"]
        assert plan["optimizer"] == unsharded["optimizer"] / WIDTH
        assert plan["correction"] == unsharded["correction"] / WIDTH
        assert plan["weights"] == unsharded["weights"] and plan["gradients"] == unsharded["gradients"]


def test_owners_are_whole_tensors_balanced_by_size():
    sizes = [torch.empty(n) for n in (100, 10, 60, 50, 5, 5)]
    owners = assign_owners(sizes, 2)
    load = [sum(t.numel() for t, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert owners == assign_owners(sizes, 2), "the same on every replica"
    assert sorted(load) == [115, 115] and max(load) - min(load) <= max(t.numel() for t in sizes)
    assert assign_owners(sizes, 1) == [0] * len(sizes)
    assert set(assign_owners(sizes, 8)) == set(range(6)), "more replicas than tensors: some own nothing"


def test_only_owners_keep_the_float32_master_and_the_rule_is_unchanged(results):
    """Issue 77: with bfloat16 weight versions and the optimizer sharded, a replica keeps the float32 master of the
    parameters it owns only; the others' weights are the bfloat16 casts their owners broadcast. Every weight is
    exactly the unsharded run's (its owner's master bit for bit, elsewhere its bfloat16 cast), and the masters
    kept over the replicas add up to one replica's whole."""
    for stage in range(DEPTH):
        ranks = [replica * DEPTH + stage for replica in range(WIDTH)]
        masters = [results[r]["bf16 sharded"]["counters"]["master_bytes"] for r in ranks]
        whole = results[ranks[0]]["bf16 whole"]["counters"]["master_bytes"]
        assert whole > 0 and sum(masters) == whole and all(0 < m < whole for m in masters), (masters, whole)
        for rank in ranks:
            sharded, reference = results[rank]["bf16 sharded"], results[rank]["bf16 whole"]["weights"]
            owned = set(sharded["stepped"])
            assert set(sharded["weights"]) == set(reference)
            for name, value in reference.items():
                got = sharded["weights"][name]
                if name in owned or name not in dict(sharded["params"]):  # its master, or a buffer
                    torch.testing.assert_close(got, value, rtol=0, atol=0, msg=f"rank {rank}: {name}")
                else:
                    assert got.dtype == torch.bfloat16, f"rank {rank}: {name} kept a float32 master"
                    assert torch.equal(got, value.to(torch.bfloat16)), f"rank {rank}: {name}"


def test_a_checkpoint_holds_every_weight_from_its_owner_at_float32(results):
    """Each replica writes only the weights whose master it keeps, all float32 (none of its bfloat16 copies), and an
    unsharded engine loading the checkpoint holds the unsharded run's float32 weights exactly."""
    for stage in range(DEPTH):
        ranks = [replica * DEPTH + stage for replica in range(WIDTH)]
        written = [set(results[r]["bf16 sharded"]["written"]) for r in ranks]
        assert set().union(*written) == set(results[ranks[0]]["bf16 whole"]["weights"]), f"stage {stage}"
        for rank in ranks:
            assert results[rank]["bf16 sharded"]["written_dtypes"] == ["torch.float32"], rank
            sharded = results[rank]["bf16 sharded"]["weights"]
            for name, value in results[rank]["bf16 whole"]["weights"].items():
                got = results[rank]["bf16 reloaded"]["weights"][name]
                torch.testing.assert_close(got, value, rtol=0, atol=0, msg=f"rank {rank}: {name}")
                # loaded sharded: the owner's master and the others' bfloat16 copies, as the run left them
                torch.testing.assert_close(
                    results[rank]["bf16 reloaded sharded"]["weights"][name], sharded[name], rtol=0, atol=0, msg=name
                )


@pytest.mark.parametrize("layout", ["4x1", "1x4"])
def test_the_sharded_master_reshards(results, layout):
    """The 2 x 2 checkpoint loaded at 4 x 1 (every master whole on one replica) and at 1 x 4 (each replica its
    quarter): what the ranks keep at float32, merged, is the unsharded run's weights exactly."""
    expected = {k: v for r in results for k, v in results[r]["bf16 whole"]["weights"].items()}
    written: dict[str, torch.Tensor] = {}
    for result in results.values():
        written.update(result[f"bf16 reloaded {layout}"]["written"])
        assert all(v.dtype == torch.float32 for v in result[f"bf16 reloaded {layout}"]["written"].values())
    assert set(written) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(written[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("run", ["shard grads", "bf16 shard grads"])
def test_sharded_gradients_keep_only_the_owners_share_aside(results, run):
    """Issue 77, ``shard_gradients`` under 2BW: one gradient bucket set (not two); batch b's set-aside holds this
    replica's share only (its owners' gradients, copied out of the set once their reduces are done, as the next batch
    first needs it), about 1/w of the stage's, and the run is the all-reduced run's rule (float32: within the
    rounding of another summation order; bf16 versions: each owner's master as the unsharded run's)."""
    for stage in range(DEPTH):
        ranks = [replica * DEPTH + stage for replica in range(WIDTH)]
        whole = results[ranks[0]]["sharded" if "bf16" not in run else "bf16 whole"]["counters"]
        set_bytes = whole["gradient_buffer_bytes"] / 2  # the all-reduced run's two sets
        kept_over_replicas = 0
        for rank in ranks:
            result = results[rank][run]
            counters, tied = result["counters"], set(result["tied"])
            assert counters["gradient_buffer_bytes"] == set_bytes, (rank, counters["gradient_buffer_bytes"], set_bytes)
            sizes = dict(result["params"])
            owned = [sizes[n] for n in result["stepped"] if n not in tied]  # its bucketed parameters
            kept = 4 * (sum(owned) + len(owned))  # float32 gradients and one flag each
            aside = 4 * sum(sizes[n] for n in tied)  # a tied gradient is set aside whole, as unsharded
            assert counters["peak_pending_gradient_bytes"] == kept + aside, (rank, counters, kept, aside)
            kept_over_replicas += kept
        assert kept_over_replicas == set_bytes, "each bucketed gradient kept by its owner alone"
        reference = "whole" if "bf16" not in run else "bf16 whole"
        for rank in ranks:
            got, expected = results[rank][run]["weights"], results[rank][reference]["weights"]
            for name, value in expected.items():
                torch.testing.assert_close(got[name].float(), value.to(got[name].dtype).float(), rtol=1e-5, atol=1e-6)
