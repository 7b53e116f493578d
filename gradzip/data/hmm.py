"""A generated language whose best possible masked-LM loss is known exactly.

``HMMLanguage`` is a stationary hidden Markov model over ``words`` tokens with ``states`` hidden
states. Every sequence of it starts in the stationary distribution, so any window of a sequence is
again a sample of the language. Given a row whose masked positions show ``[MASK]`` and whose other
positions show their token, forward-backward gives for each masked position the exact
probability of its token given every unmasked one, so the Bayes-optimal masked-LM loss of any
batch is computable (:meth:`HMMLanguage.posterior_loss`).

The generator (all drawn from the language seed):

1. Transitions: a state stays put with probability ``stay`` (a topic that lasts: then even a
   bag of the row's words predicts a masked one, and a model profits from context at once);
   otherwise it moves to one of ``branch`` successor states, with Dirichlet(1) weights, mixed with
   ``smooth`` of the uniform distribution (so the chain is ergodic).
2. Emissions: words are split into ``states`` groups; state ``k`` emits from its own group with
   Zipf(1) weights over a random order of it and, with total weight ``leak`` (default 0), from
   every word uniformly (then a word does not name its state for certain).

References for a model that ignores context: the unigram entropy H of the stationary word
distribution; with ``[MASK]``-only corruption this is also the context-free floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradzip.errors import GradzipError

DEFAULTS = {"states": 16, "words": 64, "branch": 3, "stay": 0.8, "smooth": 0.02, "leak": 0.0, "seed": 0}


def is_generated(corpus: str | None) -> bool:
    """Whether a ``--corpus`` value names a generated language (``hmm`` or ``hmm:...``)."""
    return isinstance(corpus, str) and (corpus == "hmm" or corpus.startswith("hmm:"))


@dataclass(frozen=True)
class HMMSpec:
    """``hmm:states=16,words=64,branch=3,stay=0.8,smooth=0.02,leak=0,seed=0`` (every key optional)."""

    states: int = 16
    words: int = 64
    branch: int = 3
    stay: float = 0.8
    smooth: float = 0.02
    leak: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> HMMSpec:
        name, _, rest = text.partition(":")
        if name != "hmm":
            raise GradzipError(f"not a generated-language spec: {text!r}; write hmm or hmm:states=32,words=512")
        kw: dict[str, float | int] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq or key not in DEFAULTS:
                raise GradzipError(f"bad hmm option {part!r} in {text!r}; options: "
                                   + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items()))
            try:
                kw[key] = type(DEFAULTS[key])(value)
            except ValueError:
                kind = "a whole number" if isinstance(DEFAULTS[key], int) else "a number"
                raise GradzipError(f"hmm option {key} must be {kind}, got {value!r}") from None
        spec = cls(**kw)  # type: ignore[arg-type]
        spec.check()
        return spec

    def check(self) -> None:
        if self.states < 1 or self.words < self.states:
            raise GradzipError(f"hmm needs states >= 1 and words >= states, got states={self.states}, "
                               f"words={self.words}")
        if not 1 <= self.branch <= self.states:
            raise GradzipError(f"hmm branch must be in 1..states ({self.states}), got {self.branch}")
        if not (0 <= self.smooth <= 1 and 0 <= self.leak <= 1 and 0 <= self.stay < 1):
            raise GradzipError(f"hmm smooth and leak must be in [0, 1] and stay in [0, 1), got smooth={self.smooth}, "
                               f"leak={self.leak}, stay={self.stay}")

    def __str__(self) -> str:
        return "hmm:" + ",".join(f"{k}={getattr(self, k)}" for k in DEFAULTS)


class HMMLanguage:
    """Transition matrix ``A`` (states x states), emission matrix ``B`` (states x words), start and
    stationary distribution ``pi``. Build from a spec with :meth:`generate`, or give the matrices
    (tests use tiny hand-made ones)."""

    def __init__(self, A: np.ndarray, B: np.ndarray, pi: np.ndarray | None = None) -> None:
        self.A = np.asarray(A, dtype=np.float64)
        self.B = np.asarray(B, dtype=np.float64)
        self.pi = stationary(self.A) if pi is None else np.asarray(pi, dtype=np.float64)
        self.states, self.words = self.B.shape

    @classmethod
    def generate(cls, spec: HMMSpec) -> HMMLanguage:
        rng = np.random.default_rng([spec.seed, 0x484D4D])
        k, v = spec.states, spec.words
        A = np.zeros((k, k))
        for i in range(k):
            nxt = rng.choice(k, size=spec.branch, replace=False)
            A[i, nxt] = rng.dirichlet(np.ones(spec.branch))
        A = spec.stay * np.eye(k) + (1 - spec.stay) * ((1 - spec.smooth) * A + spec.smooth / k)
        B = np.zeros((k, v))
        for i, group in enumerate(np.array_split(rng.permutation(v), k)):
            zipf = 1.0 / np.arange(1, group.size + 1)
            B[i, rng.permutation(group)] = zipf / zipf.sum()
        B = (1 - spec.leak) * B + spec.leak / v
        return cls(A, B)

    def unigram(self) -> np.ndarray:
        """The stationary distribution of words."""
        return self.pi @ self.B

    def sample(self, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` sequences of ``length`` word indices (0-based), int64."""
        cum_a, cum_b = np.cumsum(self.A, axis=1), np.cumsum(self.B, axis=1)
        z = np.searchsorted(np.cumsum(self.pi), rng.random(n) * np.cumsum(self.pi)[-1])
        out = np.empty((n, length), dtype=np.int64)
        for t in range(length):
            if t:
                z = _draw(cum_a[z], rng)
            out[:, t] = _draw(cum_b[z], rng)
        return np.minimum(out, self.words - 1)

    def posterior_loss(self, words: np.ndarray, masked: np.ndarray) -> np.ndarray:
        """``-log P(word_t | the unmasked words of its row)`` at every masked position, in row-major
        order (as the model's masked-LM loss counts them). ``words``: (rows, length) word indices;
        ``masked``: (rows, length) bool. Scaled forward-backward; masked positions emit with
        likelihood 1."""
        n, length = words.shape
        emit = np.where(masked[:, :, None], 1.0, self.B.T[words])  # (n, length, states)
        alpha = np.empty((n, length, self.states))
        a = self.pi[None, :] * emit[:, 0]
        alpha[:, 0] = a / a.sum(axis=1, keepdims=True)
        for t in range(1, length):
            a = (alpha[:, t - 1] @ self.A) * emit[:, t]
            alpha[:, t] = a / a.sum(axis=1, keepdims=True)
        beta = np.ones((n, length, self.states))
        for t in range(length - 2, -1, -1):
            b = (emit[:, t + 1] * beta[:, t + 1]) @ self.A.T
            beta[:, t] = b / b.sum(axis=1, keepdims=True)
        gamma = alpha * beta
        gamma /= gamma.sum(axis=2, keepdims=True)
        rows, cols = np.nonzero(masked)
        p = np.einsum("ik,ik->i", gamma[rows, cols], self.B[:, words[rows, cols]].T)
        return -np.log(p)


def stationary(A: np.ndarray) -> np.ndarray:
    """The stationary distribution of a row-stochastic ergodic matrix."""
    vals, vecs = np.linalg.eig(A.T)
    v = np.real(vecs[:, np.argmin(np.abs(vals - 1))])
    return v / v.sum()


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def _draw(cum: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of the cumulative distributions ``cum``."""
    u = rng.random(cum.shape[0])[:, None] * cum[:, -1:]
    return (cum < u).sum(axis=1)
