"""What one engine step costs on one worker, learned from the steps it ran.

A step runs some prefill chunks and some decodes in one forward. Its time is modelled
as a linear function of five features::

    t = c0 + c1 x prefill tokens + c2 x prefill attention + c3 x decodes + c4 x decode context

(prefill attention = sum over chunks of n x (cached + n / 2), decode context = the
tokens the decodes attend to). :class:`StepCosts` fits the coefficients online by
exponentially weighted least squares, pulled towards a prior so that it predicts
sensibly before the first step and never from a handful of outliers, and clamps them
non-negative. Workers observe every step they run and report ``to_tuple()``; the
global scheduler and the workers' step planners predict with it. It is also a
:class:`scheduler.deadlines.ServiceEstimate`, so admission, ordering and placement read
the machine's measured speed, not a constant. The simulator's workers learn the same way
from the cost model's step times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NUM_FEATURES = 5


@dataclass(frozen=True, slots=True)
class StepShape:
    """The features of one step (see the module docstring)."""

    prefill_tokens: int = 0
    prefill_attention: float = 0.0
    num_decodes: int = 0
    decode_context: int = 0

    def features(self) -> tuple[float, float, float, float, float]:
        return (1.0, float(self.prefill_tokens), self.prefill_attention,
                float(self.num_decodes), float(self.decode_context))

    @staticmethod
    def of(chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> StepShape:
        """``chunks``: (new tokens, cached tokens before them); ``decode_contexts``: each
        decode's context length."""
        return StepShape(sum(n for n, _ in chunks),
                         sum(n * (c + n / 2) for n, c in chunks),
                         len(decode_contexts), sum(decode_contexts))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        inv = 1.0 / m[col][col]
        for r in range(col + 1, n):
            f = m[r][col] * inv
            if f:
                row_r, row_c = m[r], m[col]
                for k in range(col, n + 1):
                    row_r[k] -= f * row_c[k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))
        x[r] = s / m[r][r]
    return x


# Typical feature scales (one unit of prior weight per scale), so the prior pulls every
# coefficient about equally whatever its units.
_SCALES = (1.0, 256.0, 256.0 * 512, 16.0, 16.0 * 512)


class StepCosts:
    """Online step-time model of one worker; also a ServiceEstimate."""

    def __init__(self, prior: Sequence[float], *, prior_weight: float = 4.0,
                 decay: float = 0.995, chunk_tokens: int = 256) -> None:
        if len(prior) != NUM_FEATURES or any(c < 0 for c in prior):
            raise ValueError(f"prior: {NUM_FEATURES} non-negative coefficients, got {prior}")
        self.prior = tuple(float(c) for c in prior)
        self.prior_weight = prior_weight
        self.decay = decay
        self.chunk_tokens = max(1, chunk_tokens)
        n = NUM_FEATURES
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._coef: tuple[float, ...] = self.prior
        self._dirty = False
        self.num_observed = 0
        # Typical decode batch (EWMA), for decode_token_s().
        self._typical_decodes = 1.0
        self._typical_context = 256.0
        self._decode_token_s: float | None = None  # cached until the model changes

    # -- learning -------------------------------------------------------------------

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not seconds > 0:
            return
        x = shape.features()
        d = self.decay
        for i in range(NUM_FEATURES):
            row = self._xtx[i]
            xi = x[i]
            for j in range(NUM_FEATURES):
                row[j] = d * row[j] + xi * x[j]
            self._xty[i] = d * self._xty[i] + xi * seconds
        self.num_observed += 1
        self._dirty = True
        self._decode_token_s = None
        if shape.num_decodes:
            self._typical_decodes += 0.1 * (shape.num_decodes - self._typical_decodes)
            per = shape.decode_context / shape.num_decodes
            self._typical_context += 0.1 * (per - self._typical_context)

    @property
    def coefficients(self) -> tuple[float, ...]:
        if self._dirty:
            self._dirty = False
            a = [row[:] for row in self._xtx]
            b = self._xty[:]
            for i, s in enumerate(_SCALES):
                # Ridge towards the prior: worth prior_weight steps at the feature's scale.
                lam = self.prior_weight * s * s
                a[i][i] += lam
                b[i] += lam * self.prior[i]
            # Non-negative least squares by active set: a feature whose coefficient comes
            # out negative (collinear features: a decode's count and its context grow
            # together) is fixed at 0 and the rest solved again; clamping instead would
            # leave the others fitted to a model that no longer holds.
            active = list(range(NUM_FEATURES))
            coef = [0.0] * NUM_FEATURES
            for _ in range(NUM_FEATURES):
                x = _solve([[a[i][j] for j in active] for i in active], [b[i] for i in active])
                if x is None:
                    break
                worst = min(range(len(active)), key=lambda k: x[k])
                if x[worst] >= 0:
                    for k, i in enumerate(active):
                        coef[i] = x[k]
                    self._coef = tuple(coef)
                    break
                del active[worst]
        return self._coef

    # -- predicting -----------------------------------------------------------------

    def step_s(self, shape: StepShape) -> float:
        c = self.coefficients
        return sum(ci * xi for ci, xi in zip(c, shape.features(), strict=True))

    def prefill_s(self, num_new_tokens: int, num_context_tokens: int) -> float:
        """ServiceEstimate: an isolated prefill, in chunks of ``chunk_tokens``."""
        n = max(num_new_tokens, 0)
        steps = max(1, -(-n // self.chunk_tokens))
        c = self.coefficients
        return steps * c[0] + n * c[1] + c[2] * n * (num_context_tokens + n / 2)

    def decode_token_s(self) -> float:
        """ServiceEstimate: one decode step at the worker's typical batch."""
        if self._decode_token_s is None:
            b = max(self._typical_decodes, 1.0)
            self._decode_token_s = self.step_s(StepShape(
                num_decodes=round(b), decode_context=int(b * self._typical_context)))
        return self._decode_token_s

    @property
    def typical_decode(self) -> tuple[float, float]:
        """The decode batch this worker typically runs, and its context per decode (EWMAs
        over the steps it observed): where its fitted decode costs are trustworthy."""
        return self._typical_decodes, self._typical_context

    def decode_step_s(self, num_decodes: int, context_tokens: int) -> float:
        return self.step_s(StepShape(num_decodes=num_decodes, decode_context=context_tokens))

    def tokens_within(self, seconds: float, cached: int = 0, *, base: StepShape | None = None
                      ) -> int:
        """Most prefill tokens (one chunk after ``cached`` tokens) that fit in a step of
        ``seconds``, on top of ``base`` (the decodes already in the step)."""
        c = self.coefficients
        left = seconds - self.step_s(base or StepShape())
        if left <= 0:
            return 0
        # c1 n + c2 n (cached + n/2) <= left: solve the quadratic for n.
        a, b = c[2] / 2, c[1] + c[2] * cached
        if a <= 0:
            return int(left / b) if b > 0 else 1 << 20
        disc = b * b + 4 * a * left
        return max(0, int((-b + disc ** 0.5) / (2 * a)))

    # -- wire -----------------------------------------------------------------------

    def to_tuple(self) -> tuple[float, ...]:
        return (*self.coefficients, self._typical_decodes, self._typical_context)

    def load_tuple(self, values: Sequence[float]) -> None:
        """Take a remote worker's fitted model (its report) as this one's state."""
        if len(values) != NUM_FEATURES + 2:
            return
        self._coef = tuple(max(0.0, float(v)) for v in values[:NUM_FEATURES])
        self._dirty = False
        self._decode_token_s = None
        self._typical_decodes = max(1.0, float(values[NUM_FEATURES]))
        self._typical_context = max(1.0, float(values[NUM_FEATURES + 1]))
        self.num_observed = max(self.num_observed, 1)


# Priors per hardware class, from `tierserve calibrate`-style measurements; the fit moves
# away from them within a few dozen steps.
CPU_PRIOR = (0.02, 1.6e-3, 2.0e-8, 1.5e-3, 4.0e-6)
GPU_PRIOR = (0.003, 2.5e-5, 1.0e-10, 2.0e-5, 5.0e-8)


def cost_prior(device: str) -> tuple[float, ...]:
    """The step-cost prior a worker on ``device`` starts from ("cuda..." or else the CPU's)."""
    return GPU_PRIOR if device.startswith("cuda") else CPU_PRIOR
