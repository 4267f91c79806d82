"""Issue 46: the FSDP backend's log-probs of vision-language samples equal a plain Hugging Face forward
of the same checkpoint (each sample alone, its images, the model's own M-RoPE index), on 1 rank and
DP2, packed (thd) and padded (bshd); a response holding a sampled image token is an ordinary token."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.support.fsdp_common import fsdp_flags, parse, rel_err
from tests.support.tiny_vl import tiny_vl_dir, vl_rollout_config

SIZES = [(56, 56), (112, 56), (56, 84), (84, 84), (56, 56), (140, 56)]


def vl_step(ckpt) -> dict:
    """6 samples (3 groups of 2) with one image each (4..15 image tokens), responses of 1..6 byte
    tokens; sample 4's response holds an <|image_pad|> (what a random engine may sample)."""
    from rl_plugin.models.tiny_vl import IMAGE_ID
    from rl_plugin.rollout.data.vl_prompt import rollout_prompts

    prompts = rollout_prompts(vl_rollout_config(apply_chat_template=True), ckpt)
    g = torch.Generator().manual_seed(0)
    tokens, total, resp, pixels, grids = [], [], [], [], []
    for i, size in enumerate(SIZES):
        rgb = tuple(int(c) for c in torch.randint(0, 256, (3,), generator=g))
        p = prompts.image_prompt("Colour <image> please?", [Image.new("RGB", size, rgb)])
        r = torch.randint(0, 256, (1 + i,), generator=g).tolist()
        if i == 4:
            r[2] = IMAGE_ID
        tokens += list(p) + r
        total.append(len(p) + len(r))
        resp.append(len(r))
        pixels.append(p.pixel_values)
        grids.append(p.image_grid_thw)
    n = int(sum(resp))
    return dict(
        tokens=torch.tensor(tokens),
        total_lengths=torch.tensor(total),
        response_lengths=torch.tensor(resp),
        loss_mask=torch.ones(n),
        advantages=torch.zeros(n),
        group_ids=torch.arange(6) // 2,
        pixel_values=torch.cat(pixels),
        image_grid_thw=torch.cat(grids),
        image_counts=torch.ones(6, dtype=torch.long),
    )


def hf_log_probs(ckpt, step, model=None) -> torch.Tensor:
    """Each sample alone through the HF model (input ids, its image, ``mm_token_type_ids`` for the
    rope index); sample 4 up to its sampled image token (the model would take it for an image place).
    ``model``: this one instead of ``ckpt``'s (a PEFT-wrapped one)."""
    from rl_plugin.backends.fsdp.model import load_hf_model
    from rl_plugin.models.tiny_vl import IMAGE_ID

    model = (model or load_hf_model(ckpt, attn_implementation="eager")).eval()
    out, start, patch = [], 0, 0
    for i, (t, r) in enumerate(zip(step["total_lengths"].tolist(), step["response_lengths"].tolist())):
        ids = step["tokens"][start : start + t]
        grid = step["image_grid_thw"][i : i + 1]
        pv = step["pixel_values"][patch : patch + int(grid.prod())]
        start, patch = start + t, patch + int(grid.prod())
        keep = t if i != 4 else t - r + 2  # sample 4: the response before its image token
        kinds = (ids[:keep] == IMAGE_ID).long().view(1, -1)
        with torch.no_grad():
            logits = model(
                input_ids=ids[:keep].view(1, -1), pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=kinds
            ).logits[0]
        rows = logits[t - r - 1 : keep - 1].double().log_softmax(-1)
        lp = rows.gather(1, ids[t - r : keep].view(-1, 1)).squeeze(1)
        out.append(torch.cat([lp, torch.full((r - lp.numel(),), float("nan"), dtype=torch.float64)]))
    return torch.cat(out)


def worker(rank, world, ckpt, step, layouts):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss import StepBatch
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    local = StepBatch(**step).validate().select(split_samples_for_dp(6, world)[rank])
    out = {}
    for name, flags in layouts.items():
        backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, "--fsdp-attn-implementation", "eager", *flags)))
        out[name] = backend.compute_log_probs(local).detach()
    return local.sample_index if local.sample_index is not None else None, out


LAYOUTS = {
    "thd": ["--qkv-format", "thd", "--micro-batch-size", "4"],
    "bshd": ["--qkv-format", "bshd", "--micro-batch-size", "2"],
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tiny_vl_dir(tmp_path_factory.mktemp("vl")))


@pytest.mark.parametrize("world", [1, 2])
def test_trainer_log_probs_equal_the_hf_forward(run_world, ckpt, world):
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    step = vl_step(ckpt)
    want = hf_log_probs(ckpt, step)
    per_rank = run_world(worker, world, ckpt, step, LAYOUTS)
    rl = step["response_lengths"]
    starts = torch.cumsum(rl, 0) - rl
    for name in LAYOUTS:
        got = torch.full_like(want, float("nan"))
        for rank in range(world):
            idx = split_samples_for_dp(6, world)[rank]
            rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + rl[i])) for i in idx])
            got[rows] = per_rank[rank][1][name].double()
        known = ~torch.isnan(want)
        assert int(known.sum()) == int(rl.sum()) - 3 and bool(torch.isfinite(got).all()), name
        assert rel_err(got[known], want[known]) < 2e-5, (name, rel_err(got[known], want[known]))


def train_then_save(rank, world, ckpt, step, out):
    """One optimizer step on the VL batch (advantages +-1: the weights move, vision tower included),
    then ``save_hf``; the trainer's log-probs after the step and its exported weights."""
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss import StepBatch

    batch = StepBatch(**step).validate()
    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, "--fsdp-attn-implementation", "eager", "--lr", "0.05")))
    before = {k: v.clone() for k, v in backend.export_hf_state_dict().items()}
    backend.train_step(batch, num_groups=3)
    backend.save_hf(out)
    return before, backend.export_hf_state_dict(), backend.compute_log_probs(batch).detach()


def test_save_hf_writes_a_vl_checkpoint_transformers_and_the_processor_load(run_world, ckpt, tmp_path):
    from rl_plugin.models.vl_processor import load_vl_processor

    step = vl_step(ckpt)
    rl = step["response_lengths"]
    step["advantages"] = torch.repeat_interleave(torch.tensor([1.0, -1.0] * 3), rl)
    step["old_log_probs"] = hf_log_probs(ckpt, step).float().nan_to_num(-5.0)  # sample 4's tail: any value
    out = str(tmp_path / "hf")
    before, after, trained = run_world(train_then_save, 1, ckpt, step, out)[0]
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert any(k.startswith("model.visual.") for k in moved) and any("language_model" in k for k in moved)
    # the saved directory: the model class, every weight as trained, the processor's files
    assert load_vl_processor(out).image_processor.size["longest_edge"] == 28 * 28 * 16
    want = hf_log_probs(out, step)
    known = ~torch.isnan(want)
    assert rel_err(trained.double()[known], want[known]) < 2e-5


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_thd_as_one_row_with_the_block_mask_equals_the_padded_grid(ckpt, attn):
    """thd's two forms (``packing`` module docstring) give a VL micro-batch the same response logits:
    the 3-D positions and the image mask are laid out like the tokens in both."""
    from rl_plugin.backends.fsdp.model import load_hf_model
    from rl_plugin.backends.fsdp.packing import head_sees_rows, images_placed, model_inputs
    from rl_plugin.backends.fsdp.vision import image_inputs
    from rl_plugin.loss import MicroBatchInputs, StepBatch

    model = load_hf_model(ckpt, attn_implementation=attn).eval()
    mb = MicroBatchInputs.build(StepBatch(**vl_step(ckpt)).validate(), qkv_format="thd")
    rows = {}
    for grid in (True, False):
        vision = image_inputs(model, mb)
        kwargs, row_index = model_inputs(mb, attn, torch.device("cpu"), padded_grid=grid, vision=vision)
        assert kwargs["position_ids"].shape[0] == 3 and ("logits_to_keep" in kwargs) != grid
        with torch.no_grad(), head_sees_rows(model, row_index), images_placed(model, vision):
            rows[grid] = model(**kwargs).logits.reshape(-1, model.config.text_config.vocab_size)
    assert rows[True].shape[0] == int(mb.layout.num_local_tokens)
    torch.testing.assert_close(rows[False], rows[True], atol=2e-5, rtol=0)


def tool_turn_step(ckpt, tmp_path):
    """3 samples of the two-turn hook whose tool turn shows an image (``tests.support.vl_hooks``), made
    by the hf engine: two plain, one with an ``<|image_pad|>`` in turn 1 as if sampled (loss mask 1)."""
    from rl_plugin.rollout.data.dataset import PromptRecord
    from rl_plugin.rollout.data.vl_prompt import rollout_prompts
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine
    from rl_plugin.rollout.flatten import flatten_samples
    from rl_plugin.rollout.generation.hooks import (
        Hook,
        default_sampling_params,
        engine_dispatch,
        fresh_samples,
        run_generate_hook,
    )

    prompts = rollout_prompts(vl_rollout_config(apply_chat_template=True), ckpt)
    Image.new("RGB", (56, 56), (0, 0, 255)).save(tmp_path / "blue.png")
    recs = [
        PromptRecord("Colour <image>?", 0, 0, 1, {"tool_colour": (255, 0, 0)}, "d:1", [str(tmp_path / "blue.png")]),
        PromptRecord("Colour <image>?", 0, 1, 2, {"sampled_pad": True}, "d:2", [str(tmp_path / "blue.png")]),
    ]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3)
    samples = run_generate_hook(
        Hook.load("tests.support.vl_hooks:image_tool_turn", "--custom-generate-function-path"),
        None,
        fresh_samples(prompts, recs, 2)[:3],
        default_sampling_params(params),
        engine_dispatch(HFEngine(ckpt), []),
        5,
        params,
        prompts=prompts,
    )
    flat = flatten_samples(samples)
    step = dict(
        tokens=flat.tokens,
        total_lengths=flat.total_lengths,
        response_lengths=flat.response_lengths,
        loss_mask=flat.loss_mask,
        advantages=torch.zeros_like(flat.loss_mask),
        group_ids=torch.tensor([0, 0, 1]),
        pixel_values=flat.pixel_values,
        image_grid_thw=flat.image_grid_thw,
        image_counts=flat.image_counts,
    )
    return samples, step, flat.log_probs


def tool_turn_worker(rank, world, ckpt, step, layouts):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss import StepBatch

    batch = StepBatch(**step).validate()
    out = {}
    for name, flags in layouts.items():
        backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, "--fsdp-attn-implementation", "eager", *flags)))
        out[name] = backend.compute_log_probs(batch).detach()
    return out


def test_an_image_in_a_tool_turn_is_trained_where_the_engine_saw_it(run_world, ckpt, tmp_path):
    """Positions are the model's rope index over prompt + response with the real image tokens marked
    (what the engine's re-prefill used), the tool image's embeddings at its tokens, its tokens
    never trained; the sampled-looking <|image_pad|> of sample 2 stays text."""
    from rl_plugin.backends.fsdp.model import load_hf_model
    from rl_plugin.models.tiny_vl import IMAGE_ID
    from rl_plugin.rollout.vl_turns import image_token_mask

    samples, step, engine_lps = tool_turn_step(ckpt, tmp_path)
    assert step["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]] * 3
    model = load_hf_model(ckpt, attn_implementation="eager").eval()
    want = []
    for s in samples[:2]:  # the model's own forward with both images (no sampled <|image_pad|> in these)
        assert s.tokens[len(s.tokens) - s.response_length :].count(IMAGE_ID) == 6
        kinds = torch.tensor([image_token_mask(s.tokens, s.response_length, s.loss_mask, IMAGE_ID)])
        train = s.multimodal_train_inputs
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([s.tokens]),
                pixel_values=train["pixel_values"],
                image_grid_thw=train["image_grid_thw"],
                mm_token_type_ids=kinds,
            ).logits[0]
        start = len(s.tokens) - s.response_length
        rows = logits[start - 1 : -1].double().log_softmax(-1)
        want.append(rows.gather(1, torch.tensor(s.tokens[start:]).view(-1, 1)).squeeze(1))
    want = torch.cat(want)
    mask = step["loss_mask"].bool()
    first_two = int(step["response_lengths"][:2].sum())
    # the image tokens have loss mask 0: 6 per tool turn, 3 + 3 model tokens (+ the injected id) trained
    assert step["loss_mask"].sum().item() == 6 + 6 + 7
    per_layout = run_world(tool_turn_worker, 1, ckpt, step, LAYOUTS)[0]
    for name, got in per_layout.items():
        got = got.double()
        assert rel_err(got[:first_two], want) < 2e-5, (name, rel_err(got[:first_two], want))
        # trainer vs engine on every model token (sample 2's injected id: not the engine's)
        model_tokens = mask.clone()
        model_tokens[first_two + 3] = False
        gap = (got - engine_lps.double())[model_tokens].abs().max()
        assert gap < 2e-5, (name, float(gap))


def frozen_tower_steps(rank, world, ckpt, step):
    """``--freeze-vision-tower``: two optimizer steps on this rank's share of the VL batch; the
    weights before and after, what requires grad, which parameters the optimizer holds state for,
    and the steps' grad norms."""
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss import StepBatch
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    local = StepBatch(**step).validate().select(split_samples_for_dp(6, world)[rank])
    flags = fsdp_flags(ckpt, "--fsdp-attn-implementation", "eager", "--lr", "0.05", "--freeze-vision-tower")
    backend = FSDPBackend.from_args(parse([*flags, "--multimodal-keys", '{"image": "images"}']))
    before = {k: v.clone() for k, v in backend.export_hf_state_dict().items()}
    names = {id(p): n for n, p in backend.model.named_parameters()}
    trains = {n: p.requires_grad for n, p in backend.model.named_parameters()}
    norms = [backend.train_step(local, num_groups=3)["grad_norm"] for _ in range(2)]
    with_state = sorted(names[id(p)] for p in backend.optimizer.state)
    return before, backend.export_hf_state_dict(), trains, with_state, norms


@pytest.mark.parametrize("world", [1, 2])
def test_freeze_vision_tower_keeps_the_tower_bitwise_and_trains_the_language_model(run_world, ckpt, world):
    step = vl_step(ckpt)
    rl = step["response_lengths"]
    step["advantages"] = torch.repeat_interleave(torch.tensor([1.0, -1.0] * 3), rl)
    step["old_log_probs"] = hf_log_probs(ckpt, step).float().nan_to_num(-5.0)
    before, after, trains, with_state, norms = run_world(frozen_tower_steps, world, ckpt, step)[0]
    tower = [k for k in before if k.startswith("model.visual.")]
    assert len(tower) > 20 and any("merger" in k for k in tower)
    assert all(torch.equal(after[k], before[k]) for k in tower)
    moved = [k for k in before if not k.startswith("model.visual.") and not torch.equal(after[k], before[k])]
    assert any("language_model.layers" in k for k in moved) and "lm_head.weight" in moved
    assert not any(v for k, v in trains.items() if k.startswith("model.visual."))
    assert all(v for k, v in trains.items() if not k.startswith("model.visual."))
    assert with_state and not any(k.startswith("model.visual.") for k in with_state)
    assert len(with_state) == sum(not k.startswith("model.visual.") for k in trains)
    assert all(n > 0 for n in norms)


VL = ["--multimodal-keys", '{"image": "images"}', "--fsdp-attn-implementation", "eager"]
VL_LORA = [*VL, "--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear", "--lr", "0.05"]


def lora_steps(rank, world, ckpt, step, out):
    """LoRA on the VL model: log-probs at init (adapters on and off), the full (PEFT) state before
    and after a step, an hf engine given the adapters, and ``--save-hf`` (a PEFT directory)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss import StepBatch
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    local = StepBatch(**step).validate().select(split_samples_for_dp(6, world)[rank])
    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *VL_LORA, "--save-hf-merged", out + "-merged")))
    init, base = backend.compute_log_probs(local), backend.compute_log_probs(local, role="ref")

    def full():
        sd = get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone() for k, v in sd.items()}

    before = full()
    backend.train_step(local, num_groups=3)
    after, trained = full(), backend.compute_log_probs(local).detach()
    adapters = dict(backend.stream_lora_adapters())  # collective
    merged = backend.export_hf_state_dict()
    engine_same = None
    if rank == 0:
        engine = HFEngine(ckpt, lora_scaling=8 / 4)
        engine.update_weights(adapters)
        live = engine.model.state_dict()
        engine_same = sorted(live) == sorted(merged) and all(torch.equal(live[k], merged[k]) for k in live)
    backend.save_hf(out)
    return dict(init=init, base=base, before=before, after=after, trained=trained, engine_same=engine_same)


@pytest.mark.parametrize("world", [1, 2])
def test_lora_on_the_language_model_only_with_images(run_world, ckpt, world, tmp_path):
    """--lora-rank with images: adapters on the LM's projections only (none in the tower, whose
    MLP names match), start as the base (bitwise the adapters-off pass; the HF forward within fp32),
    a step moves adapters only, the hf engine's merge equals the trainer's export bitwise, and
    ``--save-hf``'s PEFT directory on the VL model (and ``--save-hf-merged``'s VL checkpoint) scores
    as the trainer."""
    from peft import PeftModel

    from rl_plugin.backends.fsdp.lora import is_adapter_key
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp
    from rl_plugin.models.vl_processor import auto_model_class

    step = vl_step(ckpt)
    rl = step["response_lengths"]
    step["advantages"] = torch.repeat_interleave(torch.tensor([1.0, -1.0] * 3), rl)
    want = hf_log_probs(ckpt, step)
    step["old_log_probs"] = want.float().nan_to_num(-5.0)
    out = str(tmp_path / "adapter")
    r0 = run_world(lora_steps, world, ckpt, step, out)[0]
    idx = split_samples_for_dp(6, world)[0]
    starts = torch.cumsum(rl, 0) - rl
    rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + rl[i])) for i in idx])
    known = ~torch.isnan(want[rows])
    assert torch.equal(r0["init"], r0["base"])
    assert rel_err(r0["init"].double()[known], want[rows][known]) < 2e-5

    before, after = r0["before"], r0["after"]
    lora_keys = [k for k in before if is_adapter_key(k)]
    assert len(lora_keys) == 2 * 7 * 2  # A and B of 7 projections x 2 LM layers
    assert not any("visual" in k for k in lora_keys)
    assert all(torch.equal(after[k], before[k]) for k in before if not is_adapter_key(k))
    assert all(not torch.equal(after[k], before[k]) for k in lora_keys if ".lora_B." in k)
    assert r0["engine_same"] is True

    model = PeftModel.from_pretrained(auto_model_class(ckpt).from_pretrained(ckpt, dtype=torch.float32), out)
    peft_keys = [k for k in model.state_dict() if "lora_" in k]
    assert len(peft_keys) == len(lora_keys) and not any("visual" in k for k in peft_keys)
    saved = hf_log_probs(ckpt, step, model=model)[rows]
    assert rel_err(r0["trained"].double()[known], saved[known]) < 2e-5
    assert rel_err(saved[known], want[rows][known]) > 1e-4  # the adapters moved the log-probs
    merged = hf_log_probs(out + "-merged", step)[rows]  # --save-hf-merged: a plain VL checkpoint
    assert rel_err(r0["trained"].double()[known], merged[known]) < 2e-5


def frozen_tower_resume(rank, world, ckpt, step, root):
    """--freeze-vision-tower: step 1, save, step 2; then a fresh backend loads the save and steps 2."""
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss import StepBatch
    from tests.support import checkpointing

    batch = StepBatch(**step).validate()
    flags = parse([*fsdp_flags(ckpt, *VL, "--lr", "0.05", "--freeze-vision-tower")])
    backend = FSDPBackend.from_args(flags)
    backend.train_step(batch, num_groups=3)
    checkpointing.save(backend, root, 1)
    straight = backend.train_step(batch, num_groups=3), backend.export_hf_state_dict()
    again = FSDPBackend.from_args(flags)
    checkpointing.load(again, root)
    return straight, (again.train_step(batch, num_groups=3), again.export_hf_state_dict())


def test_freeze_vision_tower_resumes_bitwise(run_world, ckpt, tmp_path):
    """A checkpoint of a frozen-tower run (optimizer state for the language model only) resumes
    to the same next step, bit for bit."""
    step = vl_step(ckpt)
    step["advantages"] = torch.repeat_interleave(torch.tensor([1.0, -1.0] * 3), step["response_lengths"])
    step["old_log_probs"] = hf_log_probs(ckpt, step).float().nan_to_num(-5.0)
    (report, weights), (report2, weights2) = run_world(frozen_tower_resume, 1, ckpt, step, str(tmp_path / "s"))[0]
    assert report["grad_norm"] == report2["grad_norm"] and report["loss"] == report2["loss"]
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
