"""Weight-only quantised experts: int8 per output channel and int4 group-wise, stored
packed and dequantised to multiply (the executor's counterpart of ``moesim.models``'
``int8`` / ``int4-g32`` / ``int4-g128`` byte accounting: a test holds the stored bytes
equal to ``matrix_bytes``).

Dequantise-and-multiply is what weight-only kernels do in registers; here it is done
in whole tensors, so it checks formats and accuracy, not speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from moesim.errors import MoesimError
from moesim.models import INT4_GROUPS

FORMATS = ("int8", *INT4_GROUPS)


@dataclass(frozen=True)
class QuantMatrix:
    """One ``rows x cols`` matrix: codes plus fp16 scales (and zeros for int4)."""

    fmt: str
    rows: int
    cols: int
    codes: Tensor  # int8 [rows, cols], or uint8 [rows, ceil(cols / 2)] two int4 codes a byte
    scale: Tensor  # fp16 [rows] (int8) or [rows, groups] (int4)
    zero: Tensor | None  # fp16 [rows, groups] (int4): the value code 0 stands for

    @property
    def nbytes(self) -> int:
        extra = self.zero.numel() * self.zero.element_size() if self.zero is not None else 0
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size() + extra

    def dequantize(self) -> Tensor:
        if self.fmt == "int8":
            return self.codes.float() * self.scale.float()[:, None]
        g = INT4_GROUPS[self.fmt]
        lo, hi = self.codes & 0xF, self.codes >> 4
        q = torch.stack((lo, hi), -1).reshape(self.rows, -1)[:, : self.cols].float()
        groups = self.scale.shape[1]
        pad = groups * g - self.cols
        q = F.pad(q, (0, pad)).view(self.rows, groups, g)
        w = q * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.reshape(self.rows, groups * g)[:, : self.cols]


def quantize(w: Tensor, fmt: str) -> QuantMatrix:
    """Round-to-nearest quantisation of ``w`` [rows, cols] (cols = input dimension)."""
    if fmt not in FORMATS:
        raise MoesimError(f"executor quantised experts support {', '.join(FORMATS)}; got {fmt!r}")
    w = w.detach().float()
    rows, cols = w.shape
    if fmt == "int8":
        scale = (w.abs().amax(1) / 127).clamp_min(1e-8).half()
        codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantMatrix(fmt, rows, cols, codes, scale, None)
    g = INT4_GROUPS[fmt]
    groups = math.ceil(cols / g)
    padded = F.pad(w, (0, groups * g - cols))
    grouped = padded.view(rows, groups, g)
    # The pad of a short last group must not widen its range: take min/max of real weights.
    valid = F.pad(torch.ones(rows, cols, dtype=torch.bool), (0, groups * g - cols)).view(rows, groups, g)
    lo = torch.where(valid, grouped, torch.inf).amin(-1)
    hi = torch.where(valid, grouped, -torch.inf).amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    zero = lo.half()
    q = torch.round((grouped - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.view(rows, groups * g)[:, :cols]
    if cols % 2:
        q = F.pad(q, (0, 1))
    codes = q[:, 0::2] | (q[:, 1::2] << 4)
    return QuantMatrix(fmt, rows, cols, codes.contiguous(), scale, zero)


@dataclass(frozen=True)
class QuantExpert:
    """A SwiGLU expert whose three matrices are quantised."""

    gate: QuantMatrix
    up: QuantMatrix
    down: QuantMatrix

    @classmethod
    def from_flat(cls, w: Tensor, hidden: int, inter: int, fmt: str) -> QuantExpert:
        """From the executor's flat ``[gate (inter x hidden); up; down (hidden x inter)]`` buffer."""
        n = inter * hidden
        return cls(quantize(w[:n].view(inter, hidden), fmt), quantize(w[n:2 * n].view(inter, hidden), fmt),
                   quantize(w[2 * n:].view(hidden, inter), fmt))

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [rows, hidden] (any float dtype) -> [rows, hidden] fp32."""
        x = x.float()
        return (F.silu(x @ self.gate.dequantize().T) * (x @ self.up.dequantize().T)) @ self.down.dequantize().T

    # -- one contiguous buffer per expert: what the offloaded runtime copies -------------
    def _parts(self) -> list[Tensor]:
        """Stored tensors in buffer order: every fp16 scale and zero first, then the codes,
        so each fp16 part starts at an even byte offset (a dtype view needs it) without any
        padding: the buffer holds exactly :attr:`nbytes`."""
        halves = [t for q in (self.gate, self.up, self.down) for t in (q.scale, q.zero) if t is not None]
        return halves + [self.gate.codes, self.up.codes, self.down.codes]

    def pack(self) -> Tensor:
        """The expert as one flat uint8 buffer of :attr:`nbytes` (host; pinned by the caller
        when it is copied with ``non_blocking``)."""
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in self._parts()])

    def view(self, buf: Tensor) -> QuantExpert:
        """This expert's layout over ``buf`` (a packed copy, e.g. in a device slot): views,
        no copy."""
        parts, off = [], 0
        for t in self._parts():
            n = t.numel() * t.element_size()
            parts.append(buf[off:off + n].view(t.dtype).view(t.shape))
            off += n
        it = iter(parts)
        scales = {}
        for name in ("gate", "up", "down"):
            q = getattr(self, name)
            scales[name] = (next(it), next(it) if q.zero is not None else None)
        mats = [QuantMatrix(q.fmt, q.rows, q.cols, next(it), *scales[name])
                for name, q in (("gate", self.gate), ("up", self.up), ("down", self.down))]
        return QuantExpert(*mats)


def quantize_experts(experts: list[list[Tensor]], hidden: int, inter: int, fmt: str) -> list[list[QuantExpert]]:
    """Every routed expert of a model (``experts[layer][e]`` flat buffers; ``[]`` for a
    dense layer) quantised to ``fmt``, on the host."""
    return [[QuantExpert.from_flat(w.detach().cpu(), hidden, inter, fmt) for w in row] for row in experts]


def mix_quant(x: Tensor, ids: np.ndarray, gates: Tensor, experts) -> Tensor:
    """``sum_c gates[r, c] * expert_{ids[r, c]}(x[r])`` with quantised experts
    (``experts[e]``: a :class:`QuantExpert` on x's device); experts in increasing id order,
    as ``executor.model.mix_experts`` sums dense ones."""
    out = torch.zeros_like(x)
    for e in sorted({int(v) for v in ids.reshape(-1) if v >= 0}):
        rows, cols = np.nonzero(ids == e)
        r = torch.from_numpy(rows.astype(np.int64)).to(x.device)
        c = torch.from_numpy(cols.astype(np.int64)).to(x.device)
        y = experts[e].forward(x[r]).to(x.dtype)  # [n_e, hidden]
        out.index_add_(0, r, y * gates[r, c, None].to(y.dtype))
    return out
