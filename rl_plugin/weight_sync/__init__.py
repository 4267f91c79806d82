"""Moving the trainer's weights into the rollout engines: in place, bucketed, only what changed.

One subsystem with its state inside it. A sync is versioned (1, 2, ...) and has three sides:

- train rank 0's ``WeightPublisher`` (``publisher.py``): the train ranks export (the backend's
  ``stream_hf_weights``, collective; only the ranks that must gather do, only rank 0 gets the
  tensors), rank 0 publishes each tensor as it arrives (``publish_stream``) through the
  transports (``transport.py``: shared memory, object store, distributed) into a ``SyncHandle``;
- each engine's ``WeightReceiver`` (``receiver.py``): reads the handle through the transport that
  serves it and loads the buckets in place (``load_sync``);
- the driver's ``WeightLedger`` (``ledger.py``): which version the engines hold, what was
  published and not yet loaded, the fingerprints to compare (``--check-weight-sync``), the time.

``SyncSettings`` (``settings.py``) declares the flags (transport, bucket size, the check).

Every parameter travels at most once per sync: tied names never, a frozen tensor once (at the
first sync), a trained tensor when it changed (``changed_at``), a fused q/k/v or gate/up group
whole (``buckets.py``). In the loop the sync rides on calls made anyway: the train call of rollout
k publishes at its end, the next manager call (generate or evaluate) loads before it samples.
"""

from rl_plugin.weight_sync.buckets import changed_bitwise, fused_group, iter_buckets, plan_buckets, tensor_bytes
from rl_plugin.weight_sync.fingerprint import compare_fingerprints, weights_fingerprint
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest, node_id
from rl_plugin.weight_sync.ledger import WeightLedger
from rl_plugin.weight_sync.publisher import WeightPublisher
from rl_plugin.weight_sync.receiver import WeightReceiver, load_sync
from rl_plugin.weight_sync.settings import SyncSettings
from rl_plugin.weight_sync.transport import TRANSPORTS

__all__ = [
    "TRANSPORTS",
    "SyncHandle",
    "SyncRequest",
    "SyncSettings",
    "WeightLedger",
    "WeightPublisher",
    "WeightReceiver",
    "changed_bitwise",
    "compare_fingerprints",
    "fused_group",
    "iter_buckets",
    "load_sync",
    "node_id",
    "plan_buckets",
    "tensor_bytes",
    "weights_fingerprint",
]
