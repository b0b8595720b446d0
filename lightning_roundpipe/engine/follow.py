"""Following the module's state between calls: the tensors a trunk layer holds now, not those of setup.

Code between calls may give a layer new tensors instead of writing into the old ones (Lightning's
``StochasticWeightAveraging`` assigns new BatchNorm statistics; ``load_state_dict(assign=True)``,
``module.weight = nn.Parameter(...)``, ``param.data = ...``, ``module.to(torch.float64)``); without
following them the pipeline would keep uploading, and copying buffers back into, the tensors collected at
setup. :class:`ModuleFollower` holds what following needs between calls: the parameters the trunk dropped
(still in the user's optimizer, so never "outside the trunk") and, for CUDA devices, the host memory pinned
in place for uploads.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from lightning_roundpipe.engine.batchnorm import check_trunk as check_batchnorms
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.pinned import PinnedStorages
from lightning_roundpipe.engine.stage import StageRunner
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.engine.transport import UploadSources


class ModuleFollower:
    """Makes the engine's view of ``trunk`` what the module holds, on the caller's thread."""

    def __init__(self, trunk: Trunk, *, deferred_batchnorm: bool) -> None:
        self.trunk = trunk
        self.deferred_batchnorm = deferred_batchnorm
        self.pinned = PinnedStorages()
        self.pinning = False  # set by start_pinning: pin_memory with a CUDA device in the ring
        # parameters the trunk held until code replaced them: still in the user's optimizer, never read by the
        # pipeline again, so not "outside the trunk"
        self._retired: dict[int, weakref.ref[nn.Parameter]] = {}

    def changed_layers(self) -> list[int]:
        """The layers holding other tensors than collected: one pass of identity checks
        (:meth:`Trunk.changed_layers`), cheap enough for every call."""
        return self.trunk.changed_layers()

    def follow_layers(self, changed: list[int], runner: StageRunner, sources: UploadSources,
                      window: GradWindow) -> None:
        """Follow the layers ``changed`` named. The caller first waits for every job dispatched so far and every
        queued step: so no upload reads the old tensors or their copies meanwhile, and every buffer copy-back of
        the earlier calls has landed in the tensors it was dispatched with (the tensors the layer held then; a
        tensor the module has replaced since keeps what the caller assigned, as in plain training, where the
        earlier calls had finished before the caller's code ran).

        Then: the layers' states are collected again, the upload copies (low-precision, and async's published
        copies) of the parameters that are new or have new memory (or dtype) are made again from their current
        values, so the next upload reads what the module holds now in both modes; the other parameters' copies
        are kept (async: still the published weights). The layers' device replicas are made again at their next
        job, deferred BatchNorms found again, gradient sums held for the step cast to changed dtypes, and for
        CUDA devices the new memory pinned and what was dropped unregistered. Parameters the layers no longer
        hold stay in the user's optimizer (as in plain training) but no longer count as outside the trunk."""
        before = {id(param): param for param in self.trunk.parameters()}
        renewed: set[int] = set()
        for layer in changed:
            renewed |= self.trunk.recollect(layer)[1]
        if self.deferred_batchnorm:
            check_batchnorms(self.trunk)
        runner.follow_layers(changed)
        sources.follow(self.trunk, changed, renewed)
        after = {id(param) for param in self.trunk.parameters()}
        for key, param in before.items():
            if key not in after:
                self._retired[key] = weakref.ref(param)
        for key in after:
            self._retired.pop(key, None)
        window.follow_dtypes()
        if self.pinning:
            targets = self.pin_targets(sources)
            self.pinned.keep_only(targets)
            if self.pinned.refused is None:  # refused once (and said so): uploads stay pageable
                self.pinned.pin(targets)

    def retired_ids(self) -> set[int]:
        """Ids of the parameters the trunk held until they were replaced, while they live."""
        for key in [key for key, ref in self._retired.items() if ref() is None]:
            del self._retired[key]
        return set(self._retired)

    def start_pinning(self, sources: UploadSources) -> None:
        """Pin in place what uploads read, for CUDA devices in the ring (from then on also after each change)."""
        self.pinning = True
        self.pinned.pin(self.pin_targets(sources))

    def pin_targets(self, sources: UploadSources) -> list[torch.Tensor]:
        """What uploads read (the masters, async's published copy, the low-precision copies) and the buffers:
        what is pinned in place for CUDA devices."""
        uploaded = [sources.source(param, layer, low_precision=True)
                    for layer, state in enumerate(self.trunk.states) for param in state.params]
        return [*uploaded, *(buffer for state in self.trunk.states for buffer in state.buffers)]
