"""Weight-only quantised experts: int8 per output channel, int4 group-wise and MXFP4, stored
packed and dequantised to multiply (the executor's counterpart of ``moesim.models``'
``int8`` / ``int4-g32`` / ``int4-g128`` / ``mxfp4`` byte accounting: a test holds the
stored bytes equal to ``matrix_bytes``).

MXFP4 (OCP Microscaling, as gpt-oss stores its experts): two FP4 (E2M1) codes a byte, low
nibble first, and one E8M0 scale byte (``2**(s - 127)``) per 32 weights of a row; a
checkpoint stored so is kept packed and dequantised on use, exactly as transformers'
``convert_moe_packed_tensors`` dequantises it (tested against it).

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

FORMATS = ("int8", *INT4_GROUPS, "mxfp4")
MX_BLOCK = 32  # weights a row shares one E8M0 scale over (MXFP4)
#: The 16 values of an FP4 (E2M1) code, as transformers' ``integrations.mxfp4.FP4_VALUES``.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QuantMatrix:
    """One ``rows x cols`` matrix: codes plus fp16 scales (and zeros for int4)."""

    fmt: str
    rows: int
    cols: int
    codes: Tensor  # int8 [rows, cols], or uint8 [rows, ceil(cols / 2)] two 4-bit codes a byte (int4, mxfp4)
    scale: Tensor  # fp16 [rows] (int8) or [rows, groups] (int4); uint8 E8M0 exponents [rows, blocks] (mxfp4)
    zero: Tensor | None  # fp16 [rows, groups] (int4): the value code 0 stands for

    @property
    def nbytes(self) -> int:
        extra = self.zero.numel() * self.zero.element_size() if self.zero is not None else 0
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size() + extra

    def dequantize(self) -> Tensor:
        if self.fmt == "int8":
            return self.codes.float() * self.scale.float()[:, None]
        lo, hi = self.codes & 0xF, self.codes >> 4
        if self.fmt == "mxfp4":  # FP4 values times 2**(scale - 127) per block, as convert_moe_packed_tensors
            lut = torch.tensor(FP4_VALUES, device=self.codes.device)
            v = torch.stack((lut[lo.long()], lut[hi.long()]), -1).reshape(self.rows, -1)  # [rows, 2 * bytes]
            blocks = self.scale.shape[1]
            v = F.pad(v, (0, blocks * MX_BLOCK - v.shape[1])).view(self.rows, blocks, MX_BLOCK)
            w = torch.ldexp(v, self.scale.to(torch.int32)[..., None] - 127)
            return w.reshape(self.rows, -1)[:, : self.cols]
        g = INT4_GROUPS[self.fmt]
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
    if fmt == "mxfp4":
        return _quantize_mxfp4(w)
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


def _quantize_mxfp4(w: Tensor) -> QuantMatrix:
    """Round-to-nearest MXFP4 (OCP MX): per block of 32 weights of a row the shared exponent
    ``floor(log2(max |w|)) - 2`` (E2M1's largest exponent), values rounded to the nearest FP4
    code (ties to the smaller magnitude), clamped to +-6."""
    rows, cols = w.shape
    blocks = math.ceil(cols / MX_BLOCK)
    v = F.pad(w, (0, blocks * MX_BLOCK - cols)).view(rows, blocks, MX_BLOCK)
    amax = v.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 2, torch.zeros_like(amax))
    exp = exp.clamp(-127, 127)
    scaled = v / torch.ldexp(torch.ones_like(exp), exp.to(torch.int32))[..., None]
    grid = torch.tensor(FP4_VALUES[:8])  # the non-negative magnitudes, code = index
    mag = (scaled.abs().clamp(max=6.0)[..., None] - grid).abs().argmin(-1)  # [rows, blocks, 32]
    code = (mag | torch.where(scaled < 0, 8, 0)).to(torch.uint8).view(rows, -1)[:, :cols]
    if cols % 2:
        code = F.pad(code, (0, 1))
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return QuantMatrix("mxfp4", rows, cols, packed.contiguous(), (exp + 127).to(torch.uint8).contiguous(), None)


def mxfp4_matrix(blocks: Tensor, scales: Tensor, cols: int) -> QuantMatrix:
    """A matrix as a checkpoint stores it in MXFP4: ``blocks`` uint8 [rows, cols/32, 16] (two
    codes a byte) and ``scales`` uint8 [rows, cols/32] (gpt-oss's ``*_blocks`` / ``*_scales``)."""
    rows = blocks.shape[0]
    return QuantMatrix("mxfp4", rows, cols, blocks.reshape(rows, -1).to(torch.uint8).contiguous(),
                       scales.to(torch.uint8).contiguous(), None)


@dataclass(frozen=True)
class QuantExpert:
    """A gated expert whose three matrices are quantised; ``bias`` (gpt-oss) holds the gate,
    up and down biases ``[2 * inter + hidden]`` as stored (bf16 in gpt-oss checkpoints)."""

    gate: QuantMatrix
    up: QuantMatrix
    down: QuantMatrix
    bias: Tensor | None = None

    @classmethod
    def from_flat(cls, w: Tensor, hidden: int, inter: int, fmt: str, bias: bool = False) -> QuantExpert:
        """From the executor's flat ``[gate (inter x hidden); up; down (hidden x inter)(; biases)]``
        buffer; biases, if any, stay unquantised in bf16 (as gpt-oss stores them)."""
        n = inter * hidden
        b = w[3 * n:].to(torch.bfloat16).clone() if bias else None
        return cls(quantize(w[:n].view(inter, hidden), fmt), quantize(w[n:2 * n].view(inter, hidden), fmt),
                   quantize(w[2 * n:3 * n].view(hidden, inter), fmt), b)

    @property
    def nbytes(self) -> int:
        extra = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + extra

    def forward(self, x: Tensor, act=None) -> Tensor:
        """``x`` [rows, hidden] (any float dtype) -> [rows, hidden] fp32; ``act(g, u)`` is the
        family's gated activation (default ``silu(g) * u``)."""
        x = x.float()
        g, u = x @ self.gate.dequantize().T, x @ self.up.dequantize().T  # [rows, inter] each
        if self.bias is not None:
            b = self.bias.float()
            i = self.gate.rows
            g, u = g + b[:i], u + b[i:2 * i]
        h = F.silu(g) * u if act is None else act(g, u)
        y = h @ self.down.dequantize().T  # [rows, hidden]
        return y + self.bias.float()[2 * self.gate.rows:] if self.bias is not None else y

    # -- one contiguous buffer per expert: what the offloaded runtime copies -------------
    def _parts(self) -> list[Tensor]:
        """Stored tensors in buffer order: the biases first (any dtype: offset 0), then every
        fp16 scale and zero, then the codes and byte scales, so each multi-byte part starts
        at an offset its dtype can be viewed at without any padding: the buffer holds
        exactly :attr:`nbytes`."""
        halves = [t for q in (self.gate, self.up, self.down) for t in (q.scale, q.zero)
                  if t is not None and t.element_size() > 1]
        bytes_ = [t for q in (self.gate, self.up, self.down) for t in (q.scale,) if t.element_size() == 1]
        return ([self.bias] if self.bias is not None else []) + halves + bytes_ + [
            self.gate.codes, self.up.codes, self.down.codes]

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
        bias = next(it) if self.bias is not None else None
        mats = (self.gate, self.up, self.down)
        scale, zero = {}, {}
        for i, q in enumerate(mats):  # the multi-byte scales and zeros, in _parts order
            if q.scale.element_size() > 1:
                scale[i], zero[i] = next(it), next(it) if q.zero is not None else None
        for i, q in enumerate(mats):  # then the byte scales
            if q.scale.element_size() == 1:
                scale[i], zero[i] = next(it), None
        return QuantExpert(*[QuantMatrix(q.fmt, q.rows, q.cols, next(it), scale[i], zero[i])
                             for i, q in enumerate(mats)], bias)


def quantize_experts(experts: list[list[Tensor]], hidden: int, inter: int, fmt: str,
                     bias: bool = False) -> list[list[QuantExpert]]:
    """Every routed expert of a model (``experts[layer][e]`` flat buffers; ``[]`` for a
    dense layer) quantised to ``fmt``, on the host."""
    return [[QuantExpert.from_flat(w.detach().cpu(), hidden, inter, fmt, bias) for w in row] for row in experts]
