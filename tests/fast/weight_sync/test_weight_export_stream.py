"""The streamed weight export (``TrainBackend.stream_hf_weights`` + ``hf_weight_specs``) and its
publish (``WeightPublisher.publish_stream``), in real gloo worlds:

- Megatron TP2 x DP2: rank 0's stream equals ``export_hf_state_dict`` name for name, in order,
  bit for bit, with the shapes and dtypes ``hf_weight_specs`` announced (meta, nothing
  materialised); the other ranks get nothing; only TP rank 1 of DP rank 0 takes part in a gather
  (DP rank 1's TP group does none);
- Megatron PP2 x TP2 with tied embeddings: ``tests/fast/parity/test_pipeline.py`` runs
  ``_export_worker`` in its four-rank world (one spawn for both checks);
- FSDP DP2 with tied embeddings and dims that do not divide by 2 (uneven shards): the same,
  tied names included; rank 1 gets nothing;
- the train actor's ``export_weight_buckets`` streamed and not streamed publish the same
  fingerprint, and an engine reading the segment gets the export bit for bit;
- a publish that fails on rank 0 still finishes the gathers (the other ranks return);
- a stream that disagrees with its specs fails loud and leaves no segment that looks valid.
"""

from __future__ import annotations

import pytest
import torch


def _spec_rows(specs):
    return [(n, tuple(t.shape), t.dtype, t.device.type) for n, t in specs.items()]


def _export_worker(backend, rank, world):
    """(what rank 0 checks, how many gathers this rank joined) for one backend."""
    import torch.distributed as dist

    from rl_plugin.ray.train_actor import TrainActor
    from rl_plugin.weight_sync import SyncRequest, WeightReceiver, weights_fingerprint

    calls = {"gather": 0}
    real_gather = dist.gather

    def counting_gather(*args, **kwargs):  # the real gather, counted
        calls["gather"] += 1
        return real_gather(*args, **kwargs)

    dist.gather = counting_gather
    try:
        specs = backend.hf_weight_specs()
        streamed = [(n, t.clone()) for n, t in backend.stream_hf_weights()]
    finally:
        dist.gather = real_gather
    full = backend.export_hf_state_dict()
    out = {"streamed": len(streamed), "gathers": calls["gather"]}
    if rank == 0:
        out["spec_rows"] = _spec_rows(specs)
        out["full_rows"] = [(n, tuple(t.shape), t.dtype, "meta") for n, t in full.items()]
        out["stream_names"] = [n for n, _ in streamed]
        out["bitwise"] = all(t.dtype == full[n].dtype and torch.equal(t, full[n]) for n, t in streamed)
    # The train actor's path: streamed and not, the same published weights.
    actor = TrainActor(rank, world)
    actor.backend = backend
    fingerprints = []
    for stream in (True, False):
        actor.stream_export = stream
        request = SyncRequest(buffer_bytes=1 << 16, transport="shared_memory", fingerprint=True)
        handle = actor.export_weight_buckets(request)
        if rank == 0:
            got = {n: t.clone() for b in WeightReceiver().buckets(handle) for n, t in b.items()}
            skip = set(getattr(backend, "tied_names", ()))
            same = sorted(got) == sorted(n for n in full if n not in skip)
            same = same and all(torch.equal(got[n], full[n]) for n in got)
            fingerprints.append((handle.fingerprint == weights_fingerprint(full), same, handle.export_seconds > 0))
    # A publish that fails on rank 0 (shared memory cannot reach another node) still finishes
    # the gathers, so the other ranks return instead of waiting for ever.
    actor.stream_export = True
    try:
        far = SyncRequest(buffer_bytes=1 << 16, transport="shared_memory", engine_nodes=("another-node",))
        actor.export_weight_buckets(far)
        out["refused"] = None
    except RuntimeError as err:
        out["refused"] = str(err)
    dist.barrier()
    if rank == 0:
        actor.close_weight_sync()
    out["fingerprints"] = fingerprints
    return out


def _megatron_worker(rank, world, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    backend = MegatronBackend.from_args(
        make_args("--hf-checkpoint", hf_dir, "--tensor-model-parallel-size", "2", world_size=world)
    )
    ps = backend.parallel_state
    return dict(_export_worker(backend, rank, world), dp_rank=ps.dp_rank, tp_rank=ps.tp_rank)


def _fsdp_worker(rank, world, hf_dir):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from tests.support.fsdp_common import fsdp_flags, parse

    backend = FSDPBackend.from_args(parse(fsdp_flags(hf_dir)))
    return dict(_export_worker(backend, rank, world), tied=list(backend.tied_names))


def _check_rank0(out):
    assert out["spec_rows"] == out["full_rows"]  # names, order, shapes, dtypes; all meta
    assert out["stream_names"] == [row[0] for row in out["full_rows"]]
    assert out["bitwise"]
    # streamed, then the old path: both fingerprints are the export's; the engine reads it exactly
    assert out["fingerprints"] == [(True, True, True), (True, True, True)]
    assert "shared memory reaches one machine only" in out["refused"]


def test_megatron_stream_only_dp0_tp_group_gathers(run_world, tmp_path):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    hf_dir = str(make_tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2"))
    results = run_world(_megatron_worker, 4, hf_dir)
    by_rank = {(r["dp_rank"], r["tp_rank"]): r for r in results}
    _check_rank0(results[0])
    assert (results[0]["dp_rank"], results[0]["tp_rank"]) == (0, 0)
    tp_params = by_rank[(0, 0)]["gathers"]
    assert tp_params > 0 and by_rank[(0, 1)]["gathers"] == tp_params  # the TP peer sends each shard
    assert by_rank[(1, 0)]["gathers"] == by_rank[(1, 1)]["gathers"] == 0  # the other replica: nothing
    assert [r["streamed"] for r in results[1:]] == [0, 0, 0]
    assert [r["refused"] for r in results[1:]] == [None, None, None]
    assert results[0]["streamed"] == len(results[0]["full_rows"])


def test_fsdp_stream_with_tied_embeddings(run_world, tmp_path):
    from tests.support.fsdp_common import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path, tie_word_embeddings=True, vocab_size=127, intermediate_size=65)
    results = run_world(_fsdp_worker, 2, ckpt)
    _check_rank0(results[0])
    assert results[0]["tied"] == ["lm_head.weight"] and "lm_head.weight" in results[0]["stream_names"]
    assert results[1]["streamed"] == 0 and results[1]["refused"] is None


def test_a_stream_that_disagrees_with_its_specs_fails_loud():
    from rl_plugin.weight_sync import SyncRequest, WeightPublisher, WeightReceiver
    from rl_plugin.weight_sync.transport import specs_of

    sd = {"a.weight": torch.randn(4, 3), "b.q_proj.weight": torch.randn(2, 3), "b.k_proj.weight": torch.randn(2, 3)}
    req = SyncRequest(buffer_bytes=64, transport="shared_memory")
    pub = WeightPublisher("shared_memory")
    try:
        h1 = pub.publish_stream(specs_of(sd), iter(sd.items()), req)
        swapped = [("b.q_proj.weight", sd["b.q_proj.weight"]), ("a.weight", sd["a.weight"])]
        with pytest.raises(RuntimeError, match="streamed 'b.q_proj.weight' .* the layout expects .*'a.weight'"):
            pub.publish_stream(specs_of(sd), iter(swapped), req)
        with pytest.raises(RuntimeError, match=r"ended before 1 tensor\(s\) of its layout \(first 'b.k_proj.weight'\)"):
            pub.publish_stream(specs_of(sd), iter(list(sd.items())[:2]), req)
        with pytest.raises(RuntimeError, match="holds the weights of sync 0"):  # the aborted write is not readable
            list(WeightReceiver().buckets(h1))
        new = {k: v + 1 for k, v in sd.items()}
        h4 = pub.publish_stream(specs_of(new), iter(new.items()), req)  # the next sync rewrites the slot whole
        got = {n: t.clone() for b in WeightReceiver().buckets(h4) for n, t in b.items()}
        assert all(torch.equal(got[n], new[n]) for n in new) and h4.sent_bytes == sum(
            v.numel() * 4 for v in new.values()
        )
    finally:
        pub.close()
