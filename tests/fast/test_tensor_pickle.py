"""How rollouts, step batches and step plans travel through Ray (``rl_plugin.tensor_pickle``: the
tensors of one object in one in-band buffer instead of torch's pickling per tensor). The round
trip gives the same tensors (dtype incl. bf16 and bool, shape, values, None fields), a view
ships only its own elements, the loaded tensors are writable and independent of the source, and
a tensor that needs torch's pickling (requiring grad) keeps it. Exact equality: the same bytes
are copied, no arithmetic."""

from __future__ import annotations

import pickle
from dataclasses import fields

import torch

from rl_plugin.rollout.sample import RolloutData
from rl_plugin.step_plan import RankPlan
from rl_plugin.tensor_pickle import ALIGN, pack_tensors, unpack_tensors
from tests.support.fsdp_common import make_step, step_batch

TORCH_REBUILD = b"_rebuild_tensor"  # in a pickle only when torch pickled a tensor itself


def same_tensor(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def same(a, b) -> bool:
    """Dataclasses field by field: tensors exactly (dtype, shape, values), the rest by ==."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or x is None:
            if not same_tensor(x, y):
                return False
        elif f.name == "batch":
            if not same(x, y):
                return False
        elif f.name == "step_micro_batches":
            if [len(s) for s in x] != [len(s) for s in y] or not all(
                same_tensor(p, q) for s, t in zip(x, y) for p, q in zip(s, t)
            ):
                return False
        elif x != y:
            return False
    return True


def test_pack_exact_for_every_dtype_shape_and_view():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, generator=g, dtype=torch.float64)
    tensors = [
        torch.randint(0, 50, (13,), generator=g),  # int64
        None,
        torch.randn(3, generator=g).bfloat16(),  # numpy has no bf16: travels as its bytes
        torch.tensor([True, False, True]),
        torch.tensor(2.5, dtype=torch.float16),  # 0-dim
        torch.zeros(0, 4, dtype=torch.int32),  # empty
        base[1:4, ::2],  # a strided view: only its 3 x 4 elements travel
        base.t(),  # non-contiguous
        torch.randn(2, 3, generator=g, dtype=torch.complex64).conj(),  # lazy conjugate
    ]
    packed = pack_tensors(tensors)
    buffer, layout = packed
    assert all(entry[2] % ALIGN == 0 for entry in layout if entry is not None)
    back = unpack_tensors(pickle.loads(pickle.dumps(packed)))
    assert len(back) == len(tensors)
    for x, y in zip(tensors, back):
        assert same_tensor(None if x is None else x.resolve_conj(), y)
    # each tensor takes its own elements' bytes (a view: not its storage), rounded up to ALIGN
    sizes = [t.numel() * t.element_size() for t in tensors if t is not None]
    offsets = [entry[2] for entry in layout if entry is not None]
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [-(-n // ALIGN) * ALIGN for n in sizes[:-1]]
    assert len(buffer) == offsets[-1] + sizes[-1]
    assert pack_tensors([torch.ones(2, requires_grad=True)]) is None


def test_step_batch_round_trip_exact_writable_and_only_the_view_travels():
    batch = step_batch(make_step(0, with_ref=False))
    batch.loss_mask = batch.loss_mask.bool()
    batch.advantages = batch.advantages.bfloat16()
    data = pickle.dumps(batch)
    assert TORCH_REBUILD not in data
    back = pickle.loads(data)
    assert same(back, batch) and back.ref_log_probs is None and back.loss_mask.dtype == torch.bool
    back.tokens += 1  # writable, and not the sender's memory
    assert not torch.equal(back.tokens, batch.tokens) and same(pickle.loads(data), batch)
    sub = batch.select(torch.tensor([0]))
    sub.tokens = batch.tokens[: int(sub.total_lengths.sum())]  # a view of the whole storage
    assert same(pickle.loads(pickle.dumps(sub)), sub)
    assert len(pickle.dumps(sub)) < len(data) // 2


def test_step_batch_requiring_grad_falls_back_to_torch_pickling():
    batch = step_batch(make_step(2))
    batch.advantages = batch.advantages.clone().requires_grad_()
    data = pickle.dumps(batch)
    assert TORCH_REBUILD in data
    back = pickle.loads(data)
    assert back.advantages.requires_grad and same(back, batch)


def test_rank_plan_round_trip_with_and_without_micro_batches():
    batch = step_batch(make_step(3))
    plan = RankPlan(batch, [(0, 4), (4, 9)], [2, 3])
    back = pickle.loads(pickle.dumps(plan))
    assert back.step_micro_batches is None and same(back, plan)
    micro = [[torch.tensor([0, 1]), torch.tensor([2, 3])], [torch.arange(5)]]
    plan = RankPlan(batch, [(0, 4), (4, 9)], [2, 3], micro)
    data = pickle.dumps(plan)
    assert TORCH_REBUILD not in data
    assert same(pickle.loads(data), plan)


def test_rollout_data_round_trip_keeps_every_field():
    g = torch.Generator().manual_seed(4)
    rl = torch.randint(1, 5, (6,), generator=g)
    tl = rl + 3
    data = RolloutData(
        tokens=torch.randint(0, 16, (int(tl.sum()),), generator=g),
        total_lengths=tl,
        response_lengths=rl,
        rollout_log_probs=-torch.rand(int(rl.sum()), generator=g),
        rewards=torch.rand(6, generator=g),
        group_ids=torch.arange(3).repeat_interleave(2),
        num_groups=3,
        stats={"reward_mean": 0.25, "rollout_gen_time": 0.5},
        examples=[{"prompt": "1+1", "response": "2", "reward": 1.0}],
        dataset_state={"train_dataset": {"epoch": 0, "offset": 3}},
    )
    raw = pickle.dumps(data)
    assert TORCH_REBUILD not in raw
    back = pickle.loads(raw)
    assert same(back, data)
