"""Synthetic routing traces, so every policy can be simulated before a real trace exists.

Three knobs shape a synthetic trace, each a stand-in for a property of real routing:

- ``skew``: each MoE layer's expert popularity is Zipf(``skew``) over a random order of
  its experts (0 = uniform);
- ``reuse``: the chance that an expert a token used at a layer is used again by the
  next token at that layer (temporal locality, what a cross-token cache exploits);
- ``hit_rate``: per layer, the chance that each true expert is in the predicted set;
  the first ``early_layers`` MoE layers get ``early_hit_rate`` (router-based prediction
  is worse where the residual stream drifts).

Each knob can instead be given per MoE layer (``popularity``, ``layer_reuse``,
``layer_hit``): :func:`moesim.sim.stats.fit_synthetic` fits them to a real trace so a
short recording stretches to any length and batch (``like`` names the source).

Two more parameters:

- ``lookahead`` (N, default 1): ``pred_ids[t, m]`` is the prediction for MoE layer ``m``
  made N MoE layers earlier, at layer ``m - N``'s router, so rows ``m < N`` hold no
  prediction (-1, gates 0). **A synthetic assumption**: prediction gets worse the further
  ahead it looks, and the per-expert hit rate at distance N is the distance-1 rate raised
  to the power N (``layer_hit_rates(n_moe) ** N``: N one-layer guesses that must all be
  right). ``hit_rate``/``layer_hit`` are always the distance-1 rates.
- ``draw_seed``: the popularity (each layer's expert ranking and probabilities) comes from
  ``seed``; every draw (routing, reuse, gates, predictions, token ids) comes from
  ``draw_seed`` when given, else from ``seed``. Two traces with one ``seed`` and two
  ``draw_seed`` share their hot experts but not their routing: a calibration twin.

Sampling is exact and compiled (numba, see :func:`_draw_rows`): a token's top-k at a layer
is the experts forced back in from the previous token (each with the layer's reuse
probability, first, in the previous token's order), then sequential sampling without
replacement from the layer's popularity over the other experts -- the same law as
Gumbel-top-k (Kool et al. 2019, "Stochastic Beams and Where to Find Them",
arXiv:1903.06059) -- by rejection from Walker's alias table (Vose 1991, IEEE TSE 17(9)),
then, for a row whose rejections exceed a small budget (a very skewed popularity), by
inverting the cumulative popularity with the chosen experts cut out. A prediction keeps
each true expert with the (lookahead) hit rate and fills up the same way from the experts
that are not true. Every (quantity, layer) has its own random stream (xoshiro256+,
Blackman and Vigna 2018, seeded from ``numpy.random.SeedSequence``), so the trace does
not depend on how tokens are chunked.

:func:`synthetic_trace` holds the trace (8 bytes per token x MoE layer x batch x top-k) plus
tables of layers x experts, never tokens x experts; :func:`write_synthetic_trace` (what
``moesim synth`` runs) writes the same file a chunk at a time and holds two chunks.

The header says ``synthetic: true`` and carries these parameters (and ``lookahead`` at its
top level when it is not 1); no timing is recorded.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from moesim import __version__, budget
from moesim.errors import MoesimError
from moesim.models import ModelSpec
from moesim.outputs import check_free_space
from moesim.traces.format import Streamed, Trace, write_trace_streamed
from moesim.traces.header import make_header

#: Expert slots drawn per call of the compiled kernel (progress is reported between calls).
SCRATCH = 1 << 22


@dataclass(frozen=True)
class SyntheticParams:
    tokens: int = 256
    batch: int = 1
    prompt_len: int = 128
    skew: float = 1.0
    reuse: float = 0.3
    hit_rate: float = 0.85
    early_hit_rate: float = 0.5
    early_layers: int = 2
    seed: int = 0
    #: Per MoE layer, each expert's probability (rows sum to 1); overrides ``skew``.
    popularity: tuple[tuple[float, ...], ...] = ()
    #: Per MoE layer forced-reuse probability; overrides ``reuse``.
    layer_reuse: tuple[float, ...] = ()
    #: Per MoE layer prediction hit rate (recall@k); overrides ``hit_rate``/``early_*``.
    layer_hit: tuple[float, ...] = ()
    #: Where fitted per-layer parameters came from (a trace's name); empty when not fitted.
    like: str = ""
    #: Predictions for MoE layer m are made at layer m - lookahead (hit rate: the layer's ** lookahead).
    lookahead: int = 1
    #: Seed of every draw (routing, reuse, gates, predictions, tokens); None: ``seed``. Popularity is ``seed``'s.
    draw_seed: int | None = None
    #: False: no predictor, ``pred_ids`` all -1 (as a trace recorded or imported without one), so
    #: a trace fitted to such a trace does not invent predictions that are always wrong.
    predicted: bool = True

    def __post_init__(self) -> None:
        for name in ("tokens", "batch"):
            if getattr(self, name) < 1:
                raise MoesimError(f"synthetic trace: {name} must be >= 1")
        if self.prompt_len < 0 or self.early_layers < 0 or self.skew < 0:
            raise MoesimError("synthetic trace: prompt_len, early_layers and skew must be >= 0")
        for name in ("reuse", "hit_rate", "early_hit_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise MoesimError(f"synthetic trace: {name} must be in [0, 1]")
        for name in ("layer_reuse", "layer_hit"):
            if any(not 0 <= v <= 1 for v in getattr(self, name)):
                raise MoesimError(f"synthetic trace: every {name} value must be in [0, 1]")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, numbers.Integral) or self.lookahead < 1:
            raise MoesimError(f"synthetic trace: lookahead must be an integer >= 1, got {self.lookahead!r}")
        if self.draw_seed is not None and (isinstance(self.draw_seed, bool)
                                           or not isinstance(self.draw_seed, numbers.Integral) or self.draw_seed < 0):
            raise MoesimError(f"synthetic trace: draw_seed must be an integer >= 0 or None, got {self.draw_seed!r}")
        for row in self.popularity:
            if any(not np.isfinite(p) or p < 0 for p in row) or not sum(row) > 0:
                raise MoesimError("synthetic trace: popularity rows must be non-negative with a positive sum")

    def layer_hit_rates(self, n_moe: int) -> np.ndarray:
        if self.layer_hit:
            return np.asarray(self.layer_hit, float)
        rates = np.full(n_moe, self.hit_rate)
        rates[: self.early_layers] = self.early_hit_rate
        return rates

    def lookahead_hit_rates(self, n_moe: int) -> np.ndarray:
        """Per MoE layer, the hit rate of a prediction made ``lookahead`` layers ahead:
        the distance-1 rate to the power ``lookahead`` (the module docstring's assumption)."""
        return self.layer_hit_rates(n_moe) ** self.lookahead

    def layer_reuse_rates(self, n_moe: int) -> np.ndarray:
        return np.asarray(self.layer_reuse, float) if self.layer_reuse else np.full(n_moe, self.reuse)

    def check(self, spec: ModelSpec) -> None:
        """Per-layer parameters must match the model's MoE layers and experts (one line if not)."""
        m, e = spec.n_moe_layers, spec.n_experts
        if self.tokens < 1 or self.batch < 1 or self.prompt_len < 0 or self.early_layers < 0:
            raise MoesimError("synthetic trace: --tokens and --batch must be >= 1, --prompt-len and --early-layers >= 0")
        if not 0 <= self.skew < 1e3:
            raise MoesimError(f"synthetic trace: --skew {self.skew} must be a number in [0, 1000)")
        for name in ("reuse", "hit_rate", "early_hit_rate"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise MoesimError(f"synthetic trace: --{name.replace('_', '-')} {v} must be in [0, 1]")
        if self.lookahead != 1 and self.lookahead >= m:
            raise MoesimError(f"synthetic trace: --lookahead {self.lookahead} must be less than {spec.name}'s {m} "
                              "MoE layers (a prediction is made that many MoE layers ahead)")
        for name in ("popularity", "layer_reuse", "layer_hit"):
            v = getattr(self, name)
            if v and len(v) != m:
                raise MoesimError(f"synthetic trace: {name} has {len(v)} layers; {spec.name} has {m} MoE layers")
        if self.popularity and any(len(r) != e for r in self.popularity):
            raise MoesimError(f"synthetic trace: popularity rows must have {e} experts ({spec.name})")
        if self.popularity and any(np.count_nonzero(r) < spec.top_k for r in self.popularity):
            raise MoesimError(f"synthetic trace: every popularity row needs >= top_k={spec.top_k} non-zero experts")




def _log_popularity(spec: ModelSpec, params: SyntheticParams, rng: np.random.Generator) -> np.ndarray:
    """[moe_layers, experts] log-probabilities: fitted rows, else Zipf over a random order."""
    m, e = spec.n_moe_layers, spec.n_experts
    if params.popularity:
        p = np.asarray(params.popularity, float)
        p = p / p.sum(1, keepdims=True)
        with np.errstate(divide="ignore"):
            return np.log(p)  # -inf: never drawn
    ranks = np.argsort(rng.random((m, e)), axis=1) + 1.0
    logp = -params.skew * np.log(ranks)
    return logp - np.log(np.exp(logp).sum(1, keepdims=True))


def _alias_tables(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker/Vose alias tables per row of ``p`` [rows, n] (Vose 1991, IEEE TSE 17(9)):
    draw column j uniformly, keep it with probability prob[j], else take alias[j]."""
    rows, n = p.shape
    prob = np.ones((rows, n))
    alias = np.tile(np.arange(n), (rows, 1))
    for r in range(rows):
        q = p[r] * n / p[r].sum()
        small = [j for j in range(n) if q[j] < 1.0]
        large = [j for j in range(n) if q[j] >= 1.0]
        while small and large:
            s, g = small.pop(), large.pop()
            prob[r, s], alias[r, s] = q[s], g
            q[g] -= 1.0 - q[s]
            (small if q[g] < 1.0 else large).append(g)
    return prob, alias


def _stream_states(seq: np.random.SeedSequence, n: int) -> np.ndarray:
    """[n, 4] xoshiro256+ states, one stream per MoE layer, from ``seq`` (never all zero)."""
    st = seq.generate_state(4 * n, np.uint64).reshape(n, 4)
    st[(st == 0).all(1), 0] = 1
    return st


def _alias_words(p: np.ndarray) -> np.ndarray:
    """The alias tables packed for the kernel: per [layer, column] ``alias << 33 | threshold``,
    the threshold being the keep probability in units of 2**-32 (so 2**32 always keeps)."""
    prob, alias = _alias_tables(p)
    zero = (p <= 0) & (prob > 0)  # a never-routed column left over by rounding: always take its alias
    alias[zero] = np.argmax(p, 1)[np.nonzero(zero)[0]]
    prob[zero] = 0.0
    thr = np.clip(np.round(prob * 2.0**32), 0, 2**32).astype(np.uint64)
    return (alias.astype(np.uint64) << np.uint64(33)) | thr


def _ziggurat() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tables of Marsaglia and Tsang's ziggurat for the standard normal, 128 boxes
    ("The Ziggurat Method for Generating Random Variables", J. Stat. Softw. 5(8), 2000)."""
    kn, wn, fn = np.zeros(128, np.int64), np.zeros(128), np.zeros(128)
    m1, dn, vn = 2147483648.0, 3.442619855899, 9.91256303526217e-3
    tn = dn
    q = vn / np.exp(-0.5 * dn * dn)
    kn[0], kn[1] = int(dn / q * m1), 0
    wn[0], wn[127] = q / m1, dn / m1
    fn[0], fn[127] = 1.0, np.exp(-0.5 * dn * dn)
    for i in range(126, 0, -1):
        dn = np.sqrt(-2.0 * np.log(vn / dn + np.exp(-0.5 * dn * dn)))
        kn[i + 1] = int(dn / tn * m1)
        tn = dn
        fn[i] = np.exp(-0.5 * dn * dn)
        wn[i] = dn / m1
    return kn, wn, fn


#: A sorting network for 8 values (19 compare-exchanges, depth 6: Knuth, TAOCP vol. 3, sec. 5.3.4,
#: checked on every 0/1 input in tests/test_speed_synth.py); written out in :func:`_draw_rows`, where
#: it sorts a top-8 row's gate logits 14% faster a slot than the transposition sort (the same values).
SORT8 = (((0, 2), (1, 3), (4, 6), (5, 7)), ((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1), (2, 3), (4, 5), (6, 7)),
         ((2, 4), (3, 5)), ((1, 4), (3, 6)), ((1, 2), (3, 4), (5, 6)))  # its 6 layers


def _draw_rows(true, gates, pred, prev, t0, l0, l1, p, start, words, reuse, hit, look, st_route, st_gate, st_pred,
               kn, wn, fn):
    """Draw steps [t0, t0 + rows) of MoE layers [l0, l1) into rows [0, rows) of ``true``/``gates``/``pred``
    [rows, layers, batch, k] in place (the module docstring says what is drawn). ``prev`` [layers, batch, k]
    holds step t0 - 1's true experts (what step t0 may reuse) and is left holding the last row's.
    ``p`` [layers, E] is the popularity,
    ``start`` its exclusive cumulative sum, ``words`` the packed alias tables
    (:func:`_alias_words`), ``reuse``/``hit`` the per-layer rates (``hit`` already at the
    lookahead distance); rows of layers < ``look`` get no prediction; ``st_*`` [layers, 4]
    are the random streams, advanced in place; ``kn``/``wn``/``fn`` the ziggurat's tables.

    Why numba: every row is a short sequential loop (forced experts, then draws until k
    distinct ones), which numpy can only do by drawing a fixed surplus per row and sorting
    it: that generator took 62 s for 100,000 Qwen3-30B-A3B tokens (38.4M expert slots) on
    this project's 2-core machine. The random streams are inlined and kept in registers
    for the same reason (numpy's Generator called from numba cost ~8 ns a number there,
    xoshiro256+ ~1 ns), and the alias draw is branch-free (one packed word a column:
    9 ns a slot against 21 ns with a branch, measured)."""
    b, k = true.shape[2], true.shape[3]
    e = p.shape[1]
    ue = np.uint64(e)
    lo32 = np.uint64(0xFFFFFFFF)
    lo33 = np.uint64(0x1FFFFFFFF)
    inv53 = 1.0 / 9007199254740992.0
    mark = np.zeros(e, np.int64)
    row = np.empty(k, np.int64)
    srt = np.empty(2 * k + 1, np.int64)
    z = np.empty(k, np.float64)
    budget = 4 * k + 16

    def nxt(s0, s1, s2, s3):
        """xoshiro256+ (Blackman and Vigna 2018): a 64-bit draw and the next state."""
        r = s0 + s3
        sh = s1 << np.uint64(17)
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= sh
        s3 = (s3 << np.uint64(45)) | (s3 >> np.uint64(19))
        return r, s0, s1, s2, s3

    def normal(s0, s1, s2, s3):
        """A standard normal by the ziggurat (index from the low 7 bits, value from the top 32)."""
        r, s0, s1, s2, s3 = nxt(s0, s1, s2, s3)
        hz = np.int64(np.int32(np.uint32(r >> np.uint64(32))))
        iz = np.int64(r & np.uint64(127))
        while True:
            if abs(hz) < kn[iz]:
                return hz * wn[iz], s0, s1, s2, s3
            x = hz * wn[iz]
            if iz == 0:  # the tail beyond r (Marsaglia 1964)
                while True:
                    r, s0, s1, s2, s3 = nxt(s0, s1, s2, s3)
                    x = -np.log(1.0 - (r >> np.uint64(11)) * inv53) / 3.442619855899
                    r, s0, s1, s2, s3 = nxt(s0, s1, s2, s3)
                    y = -np.log(1.0 - (r >> np.uint64(11)) * inv53)
                    if y + y >= x * x:
                        break
                return (3.442619855899 + x if hz > 0 else -3.442619855899 - x), s0, s1, s2, s3
            r, s0, s1, s2, s3 = nxt(s0, s1, s2, s3)
            if fn[iz] + (r >> np.uint64(11)) * inv53 * (fn[iz - 1] - fn[iz]) < np.exp(-0.5 * x * x):
                return x, s0, s1, s2, s3
            r, s0, s1, s2, s3 = nxt(s0, s1, s2, s3)
            hz = np.int64(np.int32(np.uint32(r >> np.uint64(32))))
            iz = np.int64(r & np.uint64(127))

    def fill_exact(ly, n, stamp, s0, s1, s2, s3):
        """Sequential sampling over the unmarked experts by inverting the cumulative
        popularity with the marked experts' intervals cut out: O(marked + log E) a draw."""
        ns = 0
        rem = 0.0
        for j in range(e):
            if mark[j] == stamp:
                srt[ns] = j
                ns += 1
            else:
                rem += p[ly, j]
        while n < k:
            r, s0, s1, s2, s3 = nxt(s0, s1, s2, s3)
            u = (r >> np.uint64(11)) * inv53
            j = -1
            if rem > 1e-12:
                v = u * rem
                x = v
                for i in range(ns):
                    c = srt[i]
                    if start[ly, c] <= x:
                        x += p[ly, c]
                    else:
                        break
                lo, hi = 0, e
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if start[ly, mid] <= x:
                        lo = mid
                    else:
                        hi = mid
                j = lo
                if mark[j] == stamp or p[ly, j] <= 0.0:  # a rounding edge: walk the unmarked mass
                    j = -1
                    acc = 0.0
                    for jj in range(e):
                        if mark[jj] != stamp and p[ly, jj] > 0.0:
                            j = jj
                            acc += p[ly, jj]
                            if acc > v:
                                break
            if j < 0:  # no popularity left: uniform over the unmarked experts, else over those not in the row
                free = 0
                for jj in range(e):
                    if mark[jj] != stamp:
                        free += 1
                if free > 0:
                    q = int(u * free)
                    for jj in range(e):
                        if mark[jj] != stamp:
                            j = jj
                            if q == 0:
                                break
                            q -= 1
                else:
                    q = int(u * (e - n))
                    for jj in range(e):
                        used = False
                        for i in range(n):
                            if row[i] == jj:
                                used = True
                        if not used:
                            j = jj
                            if q == 0:
                                break
                            q -= 1
            if mark[j] != stamp:
                rem -= p[ly, j]
                i = ns  # keep srt sorted
                while i > 0 and srt[i - 1] > j:
                    srt[i] = srt[i - 1]
                    i -= 1
                srt[i] = j
                ns += 1
            mark[j] = stamp
            row[n] = j
            n += 1
        return n, s0, s1, s2, s3

    def fill(ly, n, stamp, s0, s1, s2, s3):
        """Append distinct unmarked experts to row[n:k]: alias draws, rejecting marked ones."""
        attempts = 0
        while n < k and attempts < budget:
            attempts += 1
            r, s0, s1, s2, s3 = nxt(s0, s1, s2, s3)
            c = ((r >> np.uint64(32)) * ue) >> np.uint64(32)
            w = words[ly, c]
            j = np.int64(c) if (r & lo32) < (w & lo33) else np.int64(w >> np.uint64(33))
            if mark[j] == stamp:
                continue  # rejected: chosen or excluded already
            mark[j] = stamp
            row[n] = j
            n += 1
        if n < k:
            return fill_exact(ly, n, stamp, s0, s1, s2, s3)
        return n, s0, s1, s2, s3

    stamp = 0
    for t in range(true.shape[0]):
        for ly in range(l0, l1):
            a0, a1, a2, a3 = st_route[ly, 0], st_route[ly, 1], st_route[ly, 2], st_route[ly, 3]
            g0, g1, g2, g3 = st_gate[ly, 0], st_gate[ly, 1], st_gate[ly, 2], st_gate[ly, 3]
            q0, q1, q2, q3 = st_pred[ly, 0], st_pred[ly, 1], st_pred[ly, 2], st_pred[ly, 3]
            for s in range(b):
                # True top-k: the previous token's experts forced back in, then popularity.
                stamp += 1
                n = 0
                if t0 + t > 0:  # branch-free: a forced expert is written always, kept when drawn
                    for j in range(k):
                        r, a0, a1, a2, a3 = nxt(a0, a1, a2, a3)
                        x = true[t - 1, ly, s, j] if t > 0 else prev[ly, s, j]
                        keep = (r >> np.uint64(11)) * inv53 < reuse[ly]
                        row[n] = x
                        mark[x] = stamp if keep else mark[x]
                        n += 1 if keep else 0
                n, a0, a1, a2, a3 = fill(ly, n, stamp, a0, a1, a2, a3)
                for j in range(k):
                    true[t, ly, s, j] = row[j]
                # Gates: softmax of k sorted normal logits, largest first.
                for i in range(k):
                    z[i], g0, g1, g2, g3 = normal(g0, g1, g2, g3)
                if k == 8:  # top-8 (most catalogue models): SORT8's 19 compare-exchanges on registers
                    z0, z1, z2, z3, z4, z5, z6, z7 = z[0], z[1], z[2], z[3], z[4], z[5], z[6], z[7]
                    z0, z2, z1, z3 = max(z0, z2), min(z0, z2), max(z1, z3), min(z1, z3)
                    z4, z6, z5, z7 = max(z4, z6), min(z4, z6), max(z5, z7), min(z5, z7)
                    z0, z4, z1, z5 = max(z0, z4), min(z0, z4), max(z1, z5), min(z1, z5)
                    z2, z6, z3, z7 = max(z2, z6), min(z2, z6), max(z3, z7), min(z3, z7)
                    z0, z1, z2, z3 = max(z0, z1), min(z0, z1), max(z2, z3), min(z2, z3)
                    z4, z5, z6, z7 = max(z4, z5), min(z4, z5), max(z6, z7), min(z6, z7)
                    z2, z4, z3, z5 = max(z2, z4), min(z2, z4), max(z3, z5), min(z3, z5)
                    z1, z4, z3, z6 = max(z1, z4), min(z1, z4), max(z3, z6), min(z3, z6)
                    z1, z2, z3, z4 = max(z1, z2), min(z1, z2), max(z3, z4), min(z3, z4)
                    z5, z6 = max(z5, z6), min(z5, z6)
                    z[0], z[1], z[2], z[3], z[4], z[5], z[6], z[7] = z0, z1, z2, z3, z4, z5, z6, z7
                else:  # odd-even transposition sort, descending: branch-free min/max
                    for i in range(k):
                        for j in range(i & 1, k - 1, 2):
                            hi_, lo_ = max(z[j], z[j + 1]), min(z[j], z[j + 1])
                            z[j], z[j + 1] = hi_, lo_
                tot = 0.0
                top = z[0]
                for j in range(k):
                    z[j] = np.exp(z[j] - top)
                    tot += z[j]
                for j in range(k):
                    gates[t, ly, s, j] = z[j] / tot
                # Prediction (made at layer l - look): each true expert kept with the hit rate,
                # the rest from the popularity among the experts that are not true.
                if ly < look:
                    for j in range(k):
                        pred[t, ly, s, j] = -1
                    continue
                stamp += 1
                for j in range(k):
                    mark[true[t, ly, s, j]] = stamp
                n = 0
                for j in range(k):
                    r, q0, q1, q2, q3 = nxt(q0, q1, q2, q3)
                    row[n] = true[t, ly, s, j]
                    n += 1 if (r >> np.uint64(11)) * inv53 < hit[ly] else 0
                n, q0, q1, q2, q3 = fill(ly, n, stamp, q0, q1, q2, q3)
                for j in range(k):
                    pred[t, ly, s, j] = row[j]
            st_route[ly, 0], st_route[ly, 1], st_route[ly, 2], st_route[ly, 3] = a0, a1, a2, a3
            st_gate[ly, 0], st_gate[ly, 1], st_gate[ly, 2], st_gate[ly, 3] = g0, g1, g2, g3
            st_pred[ly, 0], st_pred[ly, 1], st_pred[ly, 2], st_pred[ly, 3] = q0, q1, q2, q3
    last = true.shape[0] - 1
    if last >= 0:
        for ly in range(l0, l1):
            for s in range(b):
                for j in range(k):
                    prev[ly, s, j] = true[last, ly, s, j]


_ZIGGURAT = _ziggurat()
_KERNEL = None


def _kernel():
    """:func:`_draw_rows`, compiled on first use (numba costs ~0.4 s to import: only
    commands that synthesise pay it) and cached in the user's folder (:mod:`moesim.jit`)."""
    global _KERNEL
    if _KERNEL is None:
        from numba import njit

        from moesim.jit import use_user_cache  # numba: compiled on first use, not at import

        use_user_cache()
        _KERNEL = njit(cache=True, nogil=True)(_draw_rows)  # nogil: layers are drawn on threads
    return _KERNEL


def _threads() -> int:
    """Threads the generator may use: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: Expert slots from which the generator draws groups of layers on threads (below, one thread).
PARALLEL_MIN = 1 << 20


def _layer_spans(m: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous groups of the ``m`` MoE layers, as even as they come."""
    cuts = [round(i * m / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


#: The dtypes of what the kernel draws: true expert ids, their gates, predicted ids. A file stores
#: the ids narrower (one byte up to 128 experts: traces.format.id_dtype), each block cast as it is
#: written (~10 ms for 100,000 Qwen3-30B-A3B tokens); in memory they stay int16, so one compiled
#: kernel draws for every model, and a sweep's traces meet the planner kernel in the dtype it was
#: compiled for ahead (moesim.sim.sweep._warm_planner): a second dtype is a second compile.
DRAWN = (np.int16, np.float32, np.int16)


def _chunk_rows(per_token: int) -> int:
    """Steps a chunk of :data:`SCRATCH` expert slots holds (at least one)."""
    return max(1, SCRATCH // max(per_token, 1))


def _chunks(t: int, per_token: int):
    n = _chunk_rows(per_token)
    for s in range(0, t, n):
        yield s, min(t, s + n)


class _Draws:
    """One trace's tables and random streams, and the kernel run over its steps a chunk at a time."""

    def __init__(self, spec: ModelSpec, params: SyntheticParams, held_cells: float | None = None) -> None:
        params.check(spec)  # held_cells: the expert slots held at once (None: the whole trace, in memory)
        budget.check(budget.synth_estimate(spec, params.tokens, params.batch, params.prompt_len, held_cells))
        self.spec, self.params = spec, params
        # Independent streams per quantity (and per layer inside the kernel), so chunk sizes
        # never change what is drawn where; popularity from ``seed``, draws from ``draw_seed``.
        pop_seeds = np.random.SeedSequence(params.seed).spawn(5)
        draw_seeds = pop_seeds if params.draw_seed is None else np.random.SeedSequence(params.draw_seed).spawn(5)
        self.shape = (params.tokens, spec.n_moe_layers, params.batch, spec.top_k)
        m = spec.n_moe_layers
        p = np.exp(_log_popularity(spec, params, np.random.default_rng(pop_seeds[0])))
        p /= p.sum(1, keepdims=True)
        self.tables = (p, np.cumsum(p, 1) - p, _alias_words(p), np.ascontiguousarray(params.layer_reuse_rates(m), float),
                       np.ascontiguousarray(params.lookahead_hit_rates(m), float), int(params.lookahead))
        self.states = [_stream_states(s, m) for s in draw_seeds[1:4]]  # route, gates, predictions
        self.tokens_seed = draw_seeds[4]

    def run(self, rows: Callable[[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]
            ) -> Iterator[tuple[int, int, int]]:
        """Draw every step, chunk ``i`` (steps [s0, s1)) into the arrays ``rows(i, s0, s1)`` gives
        (true ids, gates, predictions, ``s1 - s0`` rows each: views of the whole trace's arrays,
        or scratch reused); yields ``(i, s0, s1)`` once a chunk is drawn."""
        t, m, b, k = self.shape
        kernel = _kernel()
        states = [s.copy() for s in self.states]
        prev = np.zeros((m, b, k), np.int16)
        # Every MoE layer draws from its own streams into its own rows, so groups of layers run
        # on threads with the same result (tests/test_speed_synth.py); the rows of one token
        # are drawn layer by layer, so the split is by layer, not by token.
        spans = _layer_spans(m, min(_threads(), m) if t * m * b * k >= PARALLEL_MIN else 1)

        def draw(arrays: tuple[np.ndarray, ...], s0: int, span: tuple[int, int]) -> None:
            kernel(*arrays, prev, s0, *span, *self.tables, *states, *_ZIGGURAT)

        pool = None
        if len(spans) > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(len(spans))
        try:
            for i, (s0, s1) in enumerate(_chunks(t, m * b * k)):
                arrays = rows(i, s0, s1)
                if pool is None:
                    draw(arrays, s0, spans[0])
                else:
                    for f in [pool.submit(draw, arrays, s0, sp) for sp in spans]:
                        f.result()
                yield i, s0, s1
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)

    def header(self) -> dict:
        params, (t, _, b, _) = self.params, self.shape
        gen = asdict(params)  # as JSON would read it back: lists, fitted values rounded
        gen["popularity"] = [[round(float(p), 6) for p in row] for row in params.popularity]
        gen["layer_reuse"] = [round(float(v), 6) for v in params.layer_reuse]
        gen["layer_hit"] = [round(float(v), 6) for v in params.layer_hit]
        gen["lookahead"] = int(params.lookahead)
        gen["draw_seed"] = None if params.draw_seed is None else int(params.draw_seed)
        if params.predicted:
            del gen["predicted"]  # said only when there are none: every other trace's header as before
        return make_header(
            self.spec, policy="none", prompt_len=params.prompt_len, n_tokens=t, batch=b, seed=params.seed,
            synthetic=True, recorded={"tool": f"moesim {__version__}", "how": "synthetic routing, no timings"
                                      + (f" (parameters fitted to {params.like})" if params.like else "")},
            lookahead=int(params.lookahead), generator={"name": "moesim.synthetic", **gen},
        )

    def token_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's and the decoded tokens' ids [batch, prompt_len] and [batch, tokens] (int32)."""
        (t, _, b, _), vocab = self.shape, self.spec.vocab
        r_tok = np.random.default_rng(self.tokens_seed)
        prompt = r_tok.integers(0, vocab, (b, self.params.prompt_len), dtype=np.int32)
        return prompt, r_tok.integers(0, vocab, (b, t), dtype=np.int32)


def synthetic_trace(spec: ModelSpec, params: SyntheticParams = SyntheticParams(),
                    progress: Callable[[int, int], None] | None = None) -> Trace:
    """Generate a trace for ``spec`` in memory (~ the output's size); ``progress(done, total)``
    counts tokens, for a progress bar on long traces. :func:`write_synthetic_trace` writes
    the same trace to a file without holding it."""
    draws = _Draws(spec, params)
    true, gates, pred = (np.empty(draws.shape, dt) for dt in DRAWN)
    for _, _, s1 in draws.run(lambda i, s0, s1: (true[s0:s1], gates[s0:s1], pred[s0:s1])):
        if progress is not None:
            progress(s1, params.tokens)
    if not params.predicted:
        pred.fill(-1)
    # A predicted slot's gate is the true gate of the same slot, where pred_ids is -1 (layers
    # before the lookahead) too: gates where nothing is predicted carry no meaning, and so the
    # file stores the gates once (format.repeated_members), 1/3 of a trace's bytes not written.
    pred_gates = gates.view()
    pred_gates.flags.writeable = False
    executed = true.view()  # a synthetic run executes the true experts (written once: moesim.traces.format)
    executed.flags.writeable = False
    return Trace(draws.header(), *draws.token_ids(), true, gates, pred, pred_gates, executed)


def write_synthetic_trace(spec: ModelSpec, params: SyntheticParams, path: str | os.PathLike,
                          progress: Callable[[int, int], None] | None = None) -> None:
    """Write :func:`synthetic_trace`'s trace to ``path`` (the same bytes as ``write_trace`` of it)
    without holding it: every chunk is drawn into scratch rows and written into the file's three
    stored members (:class:`moesim.traces.format.Streamed`), so memory is two chunks whatever the
    length, and the trace is touched once, in the file's pages, not first in memory (at ~0.4 GB/s
    for memory new to a process on this project's virtual machine, the larger cost for 100,000
    Qwen3-235B-A22B tokens: 600 MB). The ids are drawn int16 and written as the file stores them
    (:func:`moesim.traces.format.id_dtype`: int8 up to 128 experts), a block at a time."""

    per_step = spec.n_moe_layers * params.batch * spec.top_k
    rows = min(params.tokens, _chunk_rows(per_step))
    draws = _Draws(spec, params, held_cells=2 * rows * per_step)
    check_free_space(path, params.tokens * per_step * budget.TRACE_BYTES_PER_CELL,
                     f"a synthetic trace of {params.tokens} steps of {spec.name}")
    # Two sets of scratch rows: the next chunk is drawn into one while the other is written.
    scratch = [[np.empty((rows, *draws.shape[1:]), dt) for dt in DRAWN] for _ in "ab"]

    def blocks() -> Iterator[tuple[np.ndarray, ...]]:
        from concurrent.futures import ThreadPoolExecutor

        chunks = draws.run(lambda i, s0, s1: tuple(a[:s1 - s0] for a in scratch[i % 2]))
        with ThreadPoolExecutor(1) as ahead:
            nxt = ahead.submit(next, chunks, None)
            try:
                while (chunk := nxt.result()) is not None:
                    i, s0, s1 = chunk
                    if not params.predicted:
                        scratch[i % 2][2][:s1 - s0].fill(-1)  # before the next chunk is drawn into the other set
                    nxt = ahead.submit(next, chunks, None)  # into the other set, while this one is written
                    if progress is not None:
                        progress(s1, params.tokens)
                    yield tuple(a[:s1 - s0] for a in scratch[i % 2])
            finally:
                if not nxt.cancel():  # the chunk being drawn finishes before the streams close
                    nxt.exception()
                chunks.close()

    names = ("true_ids", "true_gates", "pred_ids")
    stored = Streamed({n: (draws.shape, a.dtype) for n, a in zip(names, scratch[0])}, blocks)
    write_trace_streamed(draws.header(), *draws.token_ids(), stored,
                         {"pred_gates": "true_gates", "exec_ids": "true_ids"}, path)
