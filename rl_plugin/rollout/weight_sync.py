"""Moving the trainer's weights into the rollout engines: in place, bucketed, only what changed.

One sync per rollout. All train ranks export (the backend's ``export_hf_state_dict``, each TP
shard gathered once); train rank 0's ``WeightPublisher`` turns the export into a small
``SyncHandle``; the rollout manager hands it to every engine's ``WeightReceiver``, which yields
the buckets the engine loads in place (``engine.update_weights(bucket)``). Every parameter travels
at most once per sync:

- Tied names (``lm_head.weight`` sharing the embedding's storage, the backend's ``tied_names``)
  are not sent: the engine's tied parameter follows the embedding.
- Only what changed: rank 0 keeps the last sync's weights (the shared-memory segment below) and
  compares each exported tensor bitwise with them (a strided probe first, so a trained tensor
  costs almost nothing; an unchanged one costs one read). ``changed_at[name]`` is the version
  (1, 2, ...) of the sync that last changed it; an engine that loaded version ``v`` loads the
  tensors with ``changed_at > v`` (a frozen tensor once, at the first sync). A fused group
  (``FUSED_GROUPS``: q/k/v, gate/up of a layer) always travels whole, since vLLM repacks it only
  once all its parts arrived.
- Buckets: ``plan_buckets`` cuts what is sent into buckets of at most ``--update-weight-buffer-size``
  bytes in export order, a fused group whole (a group over the budget alone in its bucket).

Transports (``--update-weight-transport``, default ``auto``):
- ``shared_memory`` (``weight_segment.py``): rank 0 writes the changed tensors into a POSIX
  shared-memory segment created once (layout cached) and reused every sync; an engine on the same
  node (Ray node id) maps it once and copies each tensor straight from its view into its
  parameter. No serialisation, no object store, no second copy.
  Double buffering (``SyncRequest.slots = 2``, overlapped training): sync ``v`` goes into slot
  ``v % 2``, so an engine still loading sync ``v - 1`` from the other slot is never overwritten
  by the publish of ``v``. Each slot remembers the version it holds (``slot_version``); writing
  ``v`` into a slot that holds ``w`` copies every tensor with ``changed_at > w`` (changed at any
  sync after ``w``, not only at ``v``), and ``changed_at`` itself compares the export with the
  other slot, which holds ``v - 1``. With one slot (the synchronous loop) ``w = v - 1``: the same
  rule writes exactly what changed.
- ``object_store``: the buckets are ``ray.put`` once by rank 0; every engine ``ray.get``s them
  (zero-copy from the object store's shared memory on a node, a network copy across nodes). The
  buckets hold the tensors changed since the version the object-store engines last loaded
  (``SyncRequest.since_version``; None: everything).
- ``auto``: shared memory for the engines on rank 0's node, the object store for the others
  (only published when some engine is elsewhere); the object store alone when ``/dev/shm``
  cannot hold the weights.
- ``nccl`` (GPU): a broadcast group between rank 0 and the engines' workers, one broadcast per
  bucket (slime / verl style). Not implemented in this build: asking for it fails loud.

``--check-weight-sync`` rides on the same calls: rank 0 fingerprints the export it just
published, every engine its weights right after loading, and the driver compares the two.

In the loop (``rl_plugin.loop.driver``) the sync rides on calls the loop makes anyway: the
train ranks export and publish at the end of their ``train_rollout_and_sync`` call, and the
rollout manager loads the handle at the start of the next ``generate`` (or ``evaluate``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from rl_plugin.arguments.weight_sync import TRANSPORTS
from rl_plugin.rollout.weight_segment import SharedWeightSegment, WeightLayout

# Hugging Face leaf modules that inference engines fuse with their siblings of the same parent.
FUSED_GROUPS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def fused_group(name: str) -> str:
    """The key of the group a tensor must travel with: ``model.layers.3.self_attn.qkv_proj`` for
    ``model.layers.3.self_attn.k_proj.bias``; the tensor's own name when it is not fused."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in FUSED_GROUPS:
        return ".".join(parts[:-2] + [FUSED_GROUPS[parts[-2]]])
    return name


def plan_buckets(sizes: Dict[str, int], buffer_bytes: int) -> List[List[str]]:
    """Names in export order cut into buckets of at most ``buffer_bytes`` (a fused group whole;
    a group over the budget alone in its bucket). ``sizes``: bytes per tensor, in export order."""
    if buffer_bytes < 1:
        raise ValueError(f"--update-weight-buffer-size must be >= 1 byte (got {buffer_bytes})")
    groups: Dict[str, List[str]] = {}
    for name in sizes:
        groups.setdefault(fused_group(name), []).append(name)
    buckets: List[List[str]] = []
    current: List[str] = []
    used = 0
    for names in groups.values():
        nbytes = sum(sizes[n] for n in names)
        if current and used + nbytes > buffer_bytes:
            buckets.append(current)
            current, used = [], 0
        current.extend(names)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(state_dict: Dict[str, torch.Tensor], buffer_bytes: int) -> Iterator[Dict[str, torch.Tensor]]:
    """The buckets of ``plan_buckets`` as dicts of CPU tensors."""
    plan = plan_buckets({k: tensor_bytes(v) for k, v in state_dict.items()}, buffer_bytes)
    for names in plan:
        yield {n: state_dict[n].detach().to("cpu").contiguous() for n in names}


PROBE_ELEMENTS = 4096  # strided elements compared first when looking for a change
BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def node_id() -> str:
    """This process's Ray node id ("local" outside Ray: every process then shares one machine)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def whole_groups(names: Sequence[str], all_names: Sequence[str]) -> List[str]:
    """``names`` widened to whole fused groups, in the order of ``all_names``."""
    groups = {fused_group(n) for n in names}
    return [n for n in all_names if fused_group(n) in groups]


def changed_bitwise(old: torch.Tensor, new: torch.Tensor) -> bool:
    """True unless ``new`` equals ``old`` bit for bit (-0.0 vs 0.0 and NaN payloads count). A
    strided probe of ``PROBE_ELEMENTS`` first: a trained tensor differs there almost surely."""
    bits = BITS_OF_SIZE[old.element_size()]  # the same-width integer type: equal ints = equal bits
    a, b = old.reshape(-1).view(bits), new.reshape(-1).view(bits)
    step = max(1, a.numel() // PROBE_ELEMENTS)
    if not torch.equal(a[::step], b[::step]):
        return True
    return not torch.equal(a, b)


@dataclass(frozen=True)
class SyncRequest:
    """What the driver asks train rank 0 to publish for one sync."""

    buffer_bytes: int  # --update-weight-buffer-size
    transport: str = "auto"  # --update-weight-transport
    engine_nodes: Sequence[str] = ()  # the Ray node id of every engine process (asked once per rollout manager)
    since_version: Optional[int] = None  # the version the object-store engines hold (None: send everything)
    fingerprint: bool = False  # --check-weight-sync
    slots: int = 1  # shared-memory buffers: 2 when an engine may load sync v - 1 while v is published


@dataclass
class SyncHandle:
    """A published sync, small enough to pass through Ray: where to read each tensor from."""

    version: int
    node_id: str  # train rank 0's node
    buffer_bytes: int
    layout: Optional[WeightLayout] = None  # shared memory: the segment's layout and path
    segment: Optional[str] = None
    changed_at: Dict[str, int] = field(default_factory=dict)  # name -> version of the sync that last changed it
    object_refs: Optional[List[Any]] = None  # object store: the buckets, tensors changed after object_since
    object_since: Optional[int] = None
    fingerprint: Optional[Dict[str, str]] = None  # --check-weight-sync: the trainer's, of this export
    sent_bytes: int = 0  # bytes written into the segment / put in the object store by rank 0
    publish_seconds: float = 0.0
    export_seconds: float = 0.0  # the backend's collective export before the publish (set by the train actor)


class WeightPublisher:
    """Train rank 0's side: keeps the segment (created at the first sync, reused after) and the
    version each tensor last changed at."""

    def __init__(self, transport: str = "auto", *, skip: Sequence[str] = ()):
        if transport not in TRANSPORTS:
            raise ValueError(f"--update-weight-transport {transport!r}: unknown; choose from {', '.join(TRANSPORTS)}")
        if transport == "nccl":
            NcclBroadcastTransport()  # fails loud: GPU-only and not implemented in this build
        self.transport = transport
        self.skip = set(skip)  # tied names: the engine's tied parameter follows its source
        self.version = 0
        self.layout: Optional[WeightLayout] = None
        self.slots: List[SharedWeightSegment] = []  # the segments, sync v in slots[v % len(slots)]
        self.slot_version: List[int] = []  # the sync each slot holds (0: not written yet)
        self.changed_at: Dict[str, int] = {}
        self.shm_failed: Optional[str] = None  # why auto fell back to the object store

    def publish(self, state_dict: Dict[str, torch.Tensor], request: SyncRequest) -> SyncHandle:
        t0 = time.perf_counter()
        here = node_id()
        sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in self.skip}
        self.version += 1
        remote = any(n != here for n in request.engine_nodes)
        use_shm = self.transport == "shared_memory" or (self.transport == "auto" and self.shm_failed is None)
        if self.transport == "shared_memory" and remote:
            far = sorted({n for n in request.engine_nodes if n != here})
            raise RuntimeError(
                f"--update-weight-transport shared_memory: rollout engines run on node(s) {far}, not on train "
                f"rank 0's node {here}; shared memory reaches one machine only. Use --update-weight-transport auto "
                "(the object store for the other nodes)"
            )
        handle = SyncHandle(version=self.version, node_id=here, buffer_bytes=request.buffer_bytes)
        if use_shm:
            self._write_segment(sd, handle, request.slots)
        if handle.segment is None or remote:  # the object store carries what the segment cannot
            since = request.since_version if handle.segment is not None else None
            names = list(sd) if since is None else whole_groups([n for n in sd if self.changed_at[n] > since], list(sd))
            import ray

            handle.object_refs = [ray.put(b) for b in iter_buckets({n: sd[n] for n in names}, request.buffer_bytes)]
            handle.object_since = since
            handle.sent_bytes += sum(tensor_bytes(sd[n]) for n in names)
        if request.fingerprint:
            from rl_plugin.rollout.manager import weights_fingerprint

            handle.fingerprint = weights_fingerprint(state_dict)
        handle.publish_seconds = time.perf_counter() - t0
        return handle

    def _write_segment(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, slots: int) -> None:
        """Write sync ``handle.version`` into its slot (the segments created, or re-created on a new
        layout or slot count) and point ``handle`` at it. On an unusable /dev/shm: raise under
        ``shared_memory``, fall back to the object store under ``auto`` (``handle.segment`` stays None)."""
        if self.layout is None or not self.layout.fits(sd) or len(self.slots) != slots:
            self.close()
            layout = WeightLayout.of(sd)
            try:
                for _ in range(slots):
                    self.slots.append(SharedWeightSegment.create(layout))
            except OSError as exc:
                self.close()
                why = (
                    f"cannot create {slots} x {layout.total_bytes / 2**20:.1f} MiB shared-memory segment(s) "
                    f"in /dev/shm ({exc})"
                )
                if self.transport == "shared_memory":
                    raise RuntimeError(
                        f"--update-weight-transport shared_memory: {why}; enlarge /dev/shm (docker --shm-size) "
                        "or use --update-weight-transport object_store"
                    ) from None
                self.shm_failed = why
                print(f"weight sync: {why}; the object store carries the weights instead", flush=True)
                return
            self.layout, self.changed_at, self.slot_version = layout, {}, [0] * slots
        v = self.version
        prev = (v - 1) % slots  # holds sync v - 1 unless nothing was written yet
        before = self.slots[prev].views if self.slot_version[prev] == v - 1 else None
        for name, value in sd.items():
            if before is None or name not in self.changed_at or changed_bitwise(before[name], value):
                self.changed_at[name] = v
        slot = v % slots
        seg, held = self.slots[slot], self.slot_version[slot]
        written = [n for n in sd if self.changed_at[n] > held]  # everything the slot missed since it held `held`
        seg.begin_write()
        for name in written:
            seg.views[name].copy_(sd[name])
        seg.end_write(v)
        self.slot_version[slot] = v
        handle.layout, handle.segment, handle.changed_at = self.layout, str(seg.path), dict(self.changed_at)
        handle.sent_bytes += sum(tensor_bytes(sd[n]) for n in written)

    def close(self) -> None:
        """Unlink the segments (teardown, or a new layout)."""
        for seg in self.slots:
            seg.close()
        self.slots, self.slot_version, self.layout = [], [], None


class WeightReceiver:
    """An engine process's side: the version it holds and its mapping of the segment."""

    def __init__(self):
        self.version = 0  # 0: the weights the engine started from (the checkpoint), not a sync
        self.layout: Optional[WeightLayout] = None
        self.segments: Dict[str, SharedWeightSegment] = {}  # path -> mapping (one per slot)
        self.node = node_id()

    def buckets(self, handle: SyncHandle) -> Iterator[Dict[str, torch.Tensor]]:
        """The buckets this engine must load to hold ``handle.version``; the version is recorded
        once the last bucket was taken."""
        if handle.segment is not None and handle.node_id == self.node:
            yield from self._from_segment(handle)
        elif handle.object_refs is not None:
            if handle.object_since is not None and handle.object_since != self.version:
                raise RuntimeError(
                    f"weight sync: this engine holds sync {self.version} but the object store carries the changes "
                    f"since sync {handle.object_since}; the driver must request a full sync (since_version None)"
                )
            import ray

            for ref in handle.object_refs:
                yield ray.get(ref)
        else:
            raise RuntimeError(
                f"weight sync: this engine (node {self.node}) cannot read train rank 0's shared-memory segment "
                f"{handle.segment} (node {handle.node_id}) and no object-store copy was published; "
                "use --update-weight-transport auto"
            )
        self.version = handle.version

    def _from_segment(self, handle: SyncHandle) -> Iterator[Dict[str, torch.Tensor]]:
        if handle.layout != self.layout:  # a new layout (the publisher's first sync, or a new model)
            self.segments, self.layout = {}, handle.layout
            self.version = 0  # everything in it is news to this engine
        seg = self.segments.get(handle.segment)
        if seg is None:
            if len(self.segments) >= 2:  # the publisher re-created its slots: drop the old mappings
                self.segments = {}
            seg = self.segments[handle.segment] = SharedWeightSegment.open(handle.segment, handle.layout)
        seg.check_version(handle.version)
        names = whole_groups([n for n in seg.layout.names if handle.changed_at[n] > self.version], seg.layout.names)
        for bucket in plan_buckets({n: seg.nbytes[n] for n in names}, handle.buffer_bytes):
            yield {n: seg.views[n] for n in bucket}
        seg.check_version(handle.version)  # the trainer did not write meanwhile


def load_sync(engine, receiver: WeightReceiver, handle: SyncHandle) -> Dict[str, Any]:
    """Load ``handle`` into ``engine`` in place; bytes, seconds (and the fingerprint under
    --check-weight-sync) for the driver."""
    t0, nbytes = time.perf_counter(), 0
    for bucket in receiver.buckets(handle):
        engine.update_weights(bucket)
        nbytes += sum(tensor_bytes(t) for t in bucket.values())
    out: Dict[str, Any] = {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}
    if handle.fingerprint is not None:
        from rl_plugin.rollout.manager import weights_fingerprint

        out["fingerprint"] = weights_fingerprint(engine.weights())
    return out


class NcclBroadcastTransport:
    """GPU path: one NCCL broadcast per bucket from train rank 0 to the engines' workers (vLLM's
    ``StatelessProcessGroup`` + ``PyNcclCommunicator`` on the engine side, SGLang's
    ``/init_weights_update_group`` + ``/update_weights_from_distributed``). Not implemented in
    this build: it needs a GPU run to write and test; shared memory (same node) and the object
    store (other nodes) carry the buckets meanwhile."""

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "--update-weight-transport nccl: the NCCL weight broadcast needs CUDA GPUs on the trainer and the "
                "rollout engines; on CPU use --update-weight-transport auto (shared memory / object store)"
            )
        raise NotImplementedError(
            "--update-weight-transport nccl: the NCCL weight broadcast between train rank 0 and the rollout "
            "engines is not implemented yet; use --update-weight-transport auto"
        )
