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
        x = x.float()
        return (F.silu(x @ self.gate.dequantize().T) * (x @ self.up.dequantize().T)) @ self.down.dequantize().T
