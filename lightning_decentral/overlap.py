"""DecentLaM's exchange in gradient buckets, started during backward.

`z = x − γ g` exists only once `g` does, so the parameters are cut into
buckets, in reverse order of registration (roughly the order backward produces
their gradients, as in DDP). When the last gradient of a bucket has been
accumulated, that bucket's trial point is computed and its exchange posted,
while backward goes on for the layers below. Buckets are posted in index order
on every rank (a ready bucket waits for its predecessors), so the message
sequence is identical everywhere, as NCCL requires.

The gradients themselves live in flat buffers too (`p.grad` is a view), so
`z` and the modified gradient `g̃` are computed with a few vector operations
per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_decentral import algorithms
from lightning_decentral.mixing import Mixer, Pending
from lightning_decentral.replicas import local_tensor, shaped_like


@dataclass
class _Segment:
    """A run of one bucket that belongs to one optimizer param group (`group=None`: not optimized)."""

    x: Tensor
    grad: Tensor
    send: Tensor
    group: int | None
    lr: float | None = None  # the group's γ when z was formed; g̃ uses the same one


@dataclass
class _Bucket:
    params: list[Parameter]
    send: Tensor
    segments: list[_Segment]
    ready: int = 0
    pending: Pending | None = None
    posted: bool = False


@dataclass
class _Flat:
    """A flat parameter buffer, its parameters, and gradient and send buffers of the same layout."""

    data: Tensor
    params: list[Parameter]
    grad: Tensor = field(init=False)
    send: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.grad = torch.zeros_like(self.data)
        self.send = torch.empty_like(self.data)
        self.params.sort(key=self.offset)

    def offset(self, param: Parameter) -> int:
        return local_tensor(param).storage_offset() - self.data.storage_offset()


class GradientBuckets:
    """Per-bucket `z = x − γ g` exchange and `g̃ = (x − W z) / γ` (docs/algorithms.md, "DecentLaM").

    Args:
        flat_parameters: the flat buffers the parameters are views of
            ([`pack_`][lightning_decentral.replicas.pack_]).
        parameters: the parameters in those buffers.
        optimizer: the optimizer; each param group's current `lr` is its `γ`.
        mixer: the exchange to run.
        bucket_bytes: the target size of one bucket.
        grad_scale: the factor the gradients carry during backward (a GradScaler's scale), or 1.
        check_finite: refuse to send a `z` holding a NaN or an Inf (off under a GradScaler, whose
            overflowing steps every rank skips together).
    """

    def __init__(
        self,
        flat_parameters: Sequence[Tensor],
        parameters: Sequence[Parameter],
        optimizer: Optimizer,
        mixer: Mixer,
        bucket_bytes: int,
        grad_scale: Callable[[], float | Tensor] = lambda: 1.0,
        check_finite: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.mixer = mixer
        self.check_finite = check_finite
        self._grad_scale = grad_scale
        self._flats = [_Flat(data, [p for p in parameters if _shares_storage(p, data)]) for data in flat_parameters]
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self._buckets = [
            _bucket(flat, chunk, group_of)
            for flat in self._flats
            for chunk in _chunks(flat.params[::-1], bucket_bytes)  # backward order: last layers first
        ]
        self._bucket_of = {id(p): bucket for bucket in self._buckets for p in bucket.params}
        self._step = -1
        self._rounds = 0
        self._next = 0  # the first bucket not posted yet
        self.listening = False  # post buckets from the gradient hooks
        self.late_gradient = False  # a gradient arrived after its bucket was posted
        self.residuals: list[Tensor] = []  # mixer.measure_residuals: each bucket's ‖z_i − Σ_j w_ij z_j‖², last step

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    # -- one step -----------------------------------------------------------------

    def attach_gradients(self) -> None:
        """Make every `p.grad` a view into the flat gradient buffers (before a backward); of a sharded parameter, a
        `DTensor` whose local shard is the view."""
        for flat in self._flats:
            for p in flat.params:
                start = flat.offset(p)
                view = flat.grad[start : start + _numel(p)]
                if p.grad is None:  # zero_grad(set_to_none=True) ran
                    p.grad = shaped_like(p, view.zero_())
                elif local_tensor(p.grad).data_ptr() != view.data_ptr():
                    p.grad = shaped_like(p, view.copy_(local_tensor(p.grad).reshape(-1)))

    def arm(self, step: int, rounds: int, listen: bool) -> None:
        """Prepare step `step` (`rounds` exchanges per bucket); `listen`: post from the gradient hooks."""
        self._step = step
        self._rounds = rounds
        self._next = 0
        self.late_gradient = False
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.pending = None
            bucket.posted = False
        self.listening = listen

    def on_gradient(self, param: Parameter) -> None:
        """Gradient hook: count `param` ready and post every bucket that now can be."""
        if not self.listening:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.posted:
            self.late_gradient = True
            return
        bucket.ready += 1
        while self._next < len(self._buckets) and self._buckets[self._next].ready == len(
            self._buckets[self._next].params
        ):
            self._post(self._buckets[self._next], self._grad_scale())

    def post_all(self, scale: float | Tensor = 1.0) -> None:
        """Post every bucket not posted yet (unused parameters, or no overlap this step)."""
        self.listening = False
        for bucket in self._buckets[self._next :]:
            self._post(bucket, scale)

    def _post(self, bucket: _Bucket, scale: float | Tensor) -> None:
        for segment in bucket.segments:
            segment.lr = self._lr(segment)
            algorithms.decentlam_trial_point_(segment.send, segment.x, segment.grad, segment.lr, scale)
        bucket.pending = self.mixer.start(
            [bucket.send], self._step, self._rounds, tag=self._next, check_finite=self.check_finite
        )
        bucket.posted = True
        self._next += 1

    def gradients_finite(self) -> Tensor:
        """A 0-dim bool tensor: no gradient is inf or NaN."""
        return torch.stack([torch.isfinite(flat.grad).all() for flat in self._flats]).all()

    def poison_gradients_if(self, condition: Tensor) -> None:
        """Where the 0-dim `condition` holds, put an inf into an optimized gradient, so that a
        GradScaler skips this step here too (no host sync)."""
        segment = next(s for b in self._buckets for s in b.segments if s.group is not None)
        first = segment.grad[:1]
        first.copy_(torch.where(condition, torch.full_like(first, float("inf")), first))

    def modify_gradients(self) -> None:
        """Post what is left, wait for every bucket, write `g̃ = (x − W z) / γ` into the (unscaled) gradients."""
        self.post_all()
        self.residuals = []
        for bucket in self._buckets:
            assert bucket.pending is not None
            bucket.pending.wait()
            self.residuals += bucket.pending.residuals or []
            bucket.pending = None
            for segment in bucket.segments:
                if segment.lr is not None:
                    algorithms.decentlam_gradient_(segment.grad, segment.x, segment.send, segment.lr)

    def drain(self) -> None:
        """Complete anything still in flight (a skipped step); leaves the gradients as they are."""
        self.listening = False
        for bucket in self._buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
                bucket.pending = None

    def _lr(self, segment: _Segment) -> float | None:
        if segment.group is None:
            return None
        return float(self.optimizer.param_groups[segment.group]["lr"])


def _shares_storage(param: Parameter, flat: Tensor) -> bool:
    return local_tensor(param).untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def _numel(param: Parameter) -> int:
    """The elements of `param` this process holds (its local shard's)."""
    return local_tensor(param).numel()


def _bucket(flat: _Flat, chunk: list[Parameter], group_of: dict[int, int]) -> _Bucket:
    """The contiguous slice of `flat` holding `chunk`, split in runs of one param group."""
    runs: list[list] = []  # [start, end, group], ascending offsets
    for p in sorted(chunk, key=flat.offset):
        start = flat.offset(p)
        group = group_of.get(id(p))
        if runs and runs[-1][2] == group and runs[-1][1] == start:
            runs[-1][1] = start + _numel(p)
        else:
            runs.append([start, start + _numel(p), group])
    segments = [_Segment(flat.data[a:b], flat.grad[a:b], flat.send[a:b], g) for a, b, g in runs]
    return _Bucket(params=chunk, send=flat.send[runs[0][0] : runs[-1][1]], segments=segments)


def _chunks(params: list[Parameter], bucket_bytes: int) -> list[list[Parameter]]:
    chunks: list[list[Parameter]] = [[]]
    size = 0
    for p in params:
        if chunks[-1] and size + _numel(p) * p.element_size() > bucket_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += _numel(p) * p.element_size()
    return [c for c in chunks if c]
