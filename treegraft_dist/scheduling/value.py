"""The value system and the exact margins the online scheduler is distilled from (offline only).

Vocabulary (D = MAX_LAYERS = 5 drafting layers per round):
  schedule        D bits; bit l = 1 iff layer l (0-based) calls the middle drafter. Schedule index
                  s = 0 .. 31 reads the bits as a binary number, layer 0 the most significant bit, so
                  s = 0 is all-small and s = 31 is all-mid.
  prefix state    the tree after the first l bits of a schedule have run, l = 0 .. D. Schedules share
                  prefixes, so one round has 1 + 2 + 4 + 8 + 16 + 32 = 63 prefix states: the 31
                  decision states (l < D, where the scheduler chooses bit l) and the 32 terminal states
                  (l = D, one per complete schedule). States are stored in heap order: the prefix p of
                  length l is state 2**l - 1 + int(p as binary); the children of state i are 2i + 1
                  (skip) and 2i + 2 (call); terminal state 31 + s ends schedule s.
  suffix          the bits after the action at a decision state of layer l: D - l - 1 bits. A value
                  head sees it as 2D numbers: D bits (0 before and at layer l) and a D-bit mask of the
                  future positions l + 1 .. D - 1.
  accepted        accepted length of a round (accepted draft tokens + the bonus token, >= 1).
  tokens/s        accepted / (latency_ms / 1000): the reward being maximised.

Trajectories (`Rounds`, plain numpy, R rounds): per prefix state its 17 signals, per complete schedule
the exact accepted length and the latency the cost profile gives it. Margins are only ever defined at
decision states: margin = Q(call) - Q(skip), Q(a) = the best tokens/s over all suffixes after taking a.

About 440 lines, kept together: the state vocabulary, the margins, the value heads, the distillation and the
value planner all index the same heap-ordered prefix states. The artifact on disk is artifact.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..decoding.schedule import NUM_SCHEDULES, SCHEDULES
from ..decoding.scheduler import LearnedScheduler, SchedulerInfo, SchedulerMLP, subset_mask
from ..decoding.signals import MAX_LAYERS, NUM_SIGNALS, SIGNAL_NAMES

D = MAX_LAYERS
NUM_DECISION_STATES = 2**D - 1  # 31
NUM_STATES = 2 ** (D + 1) - 1  # 63
SUFFIX_WIDTH = 2 * D  # future bits + future mask
_STD_FLOOR = 1e-6  # a signal constant over the training states is left unscaled
# A signal whose spread over the training states is below this fraction of its size is constant there (the
# context timings of one device's profile: float noise of a few ulps). It is left out of the fitted subset:
# its weights never learned anything, and at run time a fresh measurement a few ms off would read as
# thousands of standard deviations.
_CONSTANT_SPREAD = 1e-3
PREDICTION_RANGE = 6.0  # value-head outputs are kept within this many target std of the training mean

def state_index(prefix) -> int:
    """Heap-order index of the prefix state reached by the bits `prefix` (length 0 .. D)."""
    value = 0
    for bit in prefix:
        value = 2 * value + int(bit)
    return (1 << len(prefix)) - 1 + value


def state_prefix(i: int) -> tuple[int, ...]:
    """The bits that lead to state i (inverse of state_index)."""
    layer = (i + 1).bit_length() - 1
    value = i + 1 - (1 << layer)
    return tuple((value >> (layer - 1 - j)) & 1 for j in range(layer))


def _query_table():
    """Every (decision state, suffix) pair, grouped by state (ascending): the action values of a state
    are a max over its group. Returns the state of each query [80], the group starts [31], the suffix
    encoding [80, 2D] and the schedule reached by taking skip / call then the suffix [2, 80]."""
    states, suffixes, schedules = [], [], []
    for i in range(NUM_DECISION_STATES):
        prefix = state_prefix(i)
        layer = len(prefix)
        for tail in itertools.product((0, 1), repeat=D - layer - 1):
            enc = np.zeros(SUFFIX_WIDTH, np.float32)
            enc[layer + 1 : D] = tail
            enc[D + layer + 1 :] = 1.0
            states.append(i)
            suffixes.append(enc)
            schedules.append([state_index(prefix + (a,) + tail) - NUM_DECISION_STATES for a in (0, 1)])
    states = np.array(states, np.int64)
    starts = np.flatnonzero(np.r_[True, states[1:] != states[:-1]])
    return states, starts, np.stack(suffixes), np.array(schedules, np.int64).T


QUERY_STATE, QUERY_START, QUERY_SUFFIX, QUERY_SCHEDULE = _query_table()
NUM_QUERIES = len(QUERY_STATE)  # 80 = D * 2**(D-1): each schedule once per layer, split by its bit there


@dataclass
class Rounds:
    """Trajectories of R decoding rounds (see the module docstring for the state and schedule order)."""

    signals: np.ndarray  # [R, 63, 17] float32, prefix states in heap order
    accepted: np.ndarray  # [R, 32] float64, accepted length of schedule s (bonus included, >= 1)
    latency_ms: np.ndarray  # [R, 32] float64, > 0
    prompt_ids: np.ndarray  # [R] str: the prompt each round came from (the unit of a data split)
    benchmarks: np.ndarray  # [R] str

    def __post_init__(self):
        self.signals = np.asarray(self.signals, np.float32)
        self.accepted = np.asarray(self.accepted, np.float64)
        self.latency_ms = np.asarray(self.latency_ms, np.float64)
        self.prompt_ids = np.asarray(self.prompt_ids, str)
        self.benchmarks = np.asarray(self.benchmarks, str)
        r = len(self.signals)
        expected = {"signals": (r, NUM_STATES, NUM_SIGNALS), "accepted": (r, NUM_SCHEDULES),
                    "latency_ms": (r, NUM_SCHEDULES), "prompt_ids": (r,), "benchmarks": (r,)}
        for name, shape in expected.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"Rounds.{name} has shape {getattr(self, name).shape}, expected {shape} "
                                 f"(R rounds x {NUM_STATES} prefix states x {NUM_SIGNALS} signals; "
                                 f"{NUM_SCHEDULES} schedules)")
        if not np.isfinite(self.signals).all():
            raise ValueError("Rounds.signals holds NaN or infinity: drop those rounds before fitting")
        if not (np.isfinite(self.accepted).all() and (self.accepted >= 1).all()):
            raise ValueError("Rounds.accepted must be finite and >= 1 (the bonus token always counts)")
        if not (np.isfinite(self.latency_ms).all() and (self.latency_ms > 0).all()):
            raise ValueError("Rounds.latency_ms must be finite and > 0")

    def __len__(self) -> int:
        return len(self.signals)

    def take(self, idx) -> "Rounds":
        return Rounds(self.signals[idx], self.accepted[idx], self.latency_ms[idx], self.prompt_ids[idx],
                      self.benchmarks[idx])

    def tokens_per_s(self) -> np.ndarray:  # [R, 32]
        return self.accepted / (self.latency_ms / 1e3)

    def decision_signals(self) -> np.ndarray:  # [R * 31, 17], round-major
        return self.signals[:, :NUM_DECISION_STATES].reshape(-1, NUM_SIGNALS)


def split_rounds(rounds: Rounds, heldout_fraction: float, seed: int = 0,
                 exclude_benchmarks=("mt_bench",)) -> tuple[Rounds, Rounds]:
    """(train, heldout) by prompt, so no prompt has rounds on both sides; rounds of `exclude_benchmarks`
    are in neither (MT-Bench stays out of the offline stage entirely)."""
    keep = ~np.isin(rounds.benchmarks, list(exclude_benchmarks))
    prompts = np.unique(rounds.prompt_ids[keep])
    rng = np.random.default_rng(seed)
    held = set(rng.permutation(prompts)[: int(round(heldout_fraction * len(prompts)))].tolist())
    is_held = np.isin(rounds.prompt_ids, list(held))
    return rounds.take(np.flatnonzero(keep & ~is_held)), rounds.take(np.flatnonzero(keep & is_held))


# -- exact margins ------------------------------------------------------------------------------------

def _margins_from_queries(tps: np.ndarray) -> np.ndarray:
    """tps: [2, R, 80] tokens/s of (skip, call) then each query's suffix -> [R, 31] margins (R optional)."""
    q = np.maximum.reduceat(tps, QUERY_START, axis=-1)  # [2, R, 31]
    return q[1] - q[0]


def feasible(max_calls: int | None) -> np.ndarray:  # [32] bool
    """Schedules within a per-round call budget (all of them without one)."""
    return np.ones(NUM_SCHEDULES, bool) if max_calls is None else SCHEDULES.sum(1) <= max_calls


def oracle_margins(accepted: np.ndarray, latency_ms: np.ndarray, max_calls: int | None = None) -> np.ndarray:
    """Exact margins of every decision state from the recorded table of the 32 schedules; schedules over
    `max_calls` middle calls count as 0 tokens/s.

    accepted, latency_ms: [R, 32] (or [32]) -> [R, 31] (or [31]), decision states in heap order."""
    tps = np.asarray(accepted, np.float64) / (np.asarray(latency_ms, np.float64) / 1e3) * feasible(max_calls)
    return _margins_from_queries(np.moveaxis(tps[..., QUERY_SCHEDULE], -2, 0))


# -- the value system ---------------------------------------------------------------------------------

HEADS = ("accepted_skip", "accepted_call", "loglat_skip", "loglat_call")


def _mlp(inputs: int, hidden: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def _train(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, seed: int, epochs: int, lr: float,
           batch: int) -> None:
    """Adam on MSE, mini-batches in a seeded order. x: [n, in] float32, y: [n] standardised targets."""
    xt, yt = torch.from_numpy(np.ascontiguousarray(x, np.float32)), torch.from_numpy(y.astype(np.float32))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed)
    net.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=order).split(batch):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(xt[idx]).squeeze(-1), yt[idx])
            loss.backward()
            opt.step()
    net.eval()


def _train_together(nets: list[torch.nn.Sequential], xs: list[np.ndarray], ys: list[np.ndarray], seeds: list[int],
                    epochs: int, lr: float, batch: int) -> None:
    """`_train` of several `_mlp`s of one shape in one loop: each net on its own inputs, targets and mini-batch
    order (its seed), their weights stacked into batched products under one Adam, which updates every
    element on its own. Each net learns what it would alone, up to the order of floating-point sums; the
    loop's per-step cost is paid once for all of them. xs: [n, in] float32 each, ys: [n] each (one n)."""
    if not nets:
        return
    x = torch.stack([torch.from_numpy(np.ascontiguousarray(a, np.float32)) for a in xs])  # [H, n, in]
    y = torch.stack([torch.from_numpy(np.asarray(b, np.float32)) for b in ys])  # [H, n]
    layers = [[m for m in net if isinstance(m, torch.nn.Linear)] for net in nets]
    depth = len(layers[0])
    weights = [torch.stack([ls[i].weight.detach().t() for ls in layers]).contiguous().requires_grad_()
               for i in range(depth)]  # [H, in, out]
    biases = [torch.stack([ls[i].bias.detach() for ls in layers])[:, None].contiguous().requires_grad_()
              for i in range(depth)]  # [H, 1, out]
    opt = torch.optim.Adam(weights + biases, lr=lr)
    orders = [torch.Generator().manual_seed(s) for s in seeds]
    which = torch.arange(len(nets))[:, None]
    for _ in range(epochs):
        perm = torch.stack([torch.randperm(x.shape[1], generator=g) for g in orders])  # [H, n]
        for idx in perm.split(batch, dim=1):  # [H, b]
            opt.zero_grad(set_to_none=True)
            h = x[which, idx]
            for i in range(depth):
                h = torch.baddbmm(biases[i], h, weights[i])
                h = torch.relu(h) if i < depth - 1 else h
            loss = ((h.squeeze(-1) - y[which, idx]) ** 2).mean(1).sum()  # each net's MSE; their gradients are apart
            loss.backward()
            opt.step()
    with torch.no_grad():
        for k, ls in enumerate(layers):
            for i, layer in enumerate(ls):
                layer.weight.copy_(weights[i][k].t())
                layer.bias.copy_(biases[i][k, 0])
    for net in nets:
        net.eval()


def _zscore(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # x: [n, 17] -> mean [17], std [17]
    mean = x.mean(0)
    std = x.std(0)
    return mean.astype(np.float32), np.where(_constant(mean, std), 1.0, std).astype(np.float32)


def _constant(mean: np.ndarray, std: np.ndarray) -> np.ndarray:  # [17] bool
    return (std < _STD_FLOOR) | (std < _CONSTANT_SPREAD * np.maximum(1.0, np.abs(mean)))


def informative(subset, x: np.ndarray) -> tuple[str, ...]:
    """`subset` less the signals constant over the training states `x` [n, 17] (see _CONSTANT_SPREAD)."""
    x = np.asarray(x, np.float64).reshape(-1, NUM_SIGNALS)
    constant = _constant(x.mean(0), x.std(0))
    kept = tuple(n for n in subset if not constant[SIGNAL_NAMES.index(n)])
    if not kept:
        raise ValueError(f"every signal of {tuple(subset)} is constant over the {len(x)} training states: "
                         "collect trajectories of more prompts")
    return kept


@dataclass
class ValueHeads:
    """Four independent MLPs over (z-scored state signals of the subset, suffix encoding): accepted length
    and log-latency (log ms) of the whole schedule, each under call and under skip at that state."""

    subset: tuple[str, ...]
    mean: np.ndarray  # [17]
    std: np.ndarray  # [17]
    nets: dict[str, torch.nn.Sequential]  # HEADS -> [n, 17 + 2D] -> [n, 1], standardised output
    target_norm: dict[str, tuple[float, float]]  # HEADS -> (mean, std) of its training target
    mask: np.ndarray = field(init=False)  # [17] float32, 1 for a signal in the subset

    def __post_init__(self):
        self.mask = subset_mask(self.subset)

    @classmethod
    def untrained(cls, subset, mean: np.ndarray, std: np.ndarray, hidden: int = 64) -> "ValueHeads":
        """Freshly initialised nets (from torch's global RNG), targets left unscaled: mean [17], std [17]."""
        nets = {h: _mlp(NUM_SIGNALS + SUFFIX_WIDTH, hidden).eval() for h in HEADS}
        return cls(tuple(subset), mean, std, nets, {h: (0.0, 1.0) for h in HEADS})

    @property
    def hidden(self) -> int:
        return self.nets[HEADS[0]][0].out_features

    def _standardise(self, signals: np.ndarray) -> np.ndarray:  # [..., 17] -> [..., 17] float32
        return (np.asarray(signals, np.float32) - self.mean) / self.std * self.mask

    def _inputs(self, signals: np.ndarray, suffix: np.ndarray) -> torch.Tensor:  # [n, 17], [n, 2D] -> [n, 17 + 2D]
        return torch.from_numpy(np.concatenate([self._standardise(signals), suffix], axis=-1).astype(np.float32))

    @torch.no_grad()
    def _forward(self, x: torch.Tensor) -> dict[str, np.ndarray]:  # x: [n, 17 + 2D] -> HEADS -> [n]
        out = {}
        for h in HEADS:
            mu, sd = self.target_norm[h]
            # Far outside the training states a head extrapolates without bound; keep its prediction
            # within PREDICTION_RANGE standard deviations of what it was fitted on (and latency finite).
            out[h] = np.clip(self.nets[h](x).squeeze(-1).double().numpy() * sd + mu,
                             mu - PREDICTION_RANGE * sd, mu + PREDICTION_RANGE * sd)
        return out

    def predict(self, signals: np.ndarray, suffix: np.ndarray) -> dict[str, np.ndarray]:
        """signals: [n, 17], suffix: [n, 2D] -> HEADS -> [n] in target units (tokens, log ms)."""
        return self._forward(self._inputs(signals, suffix))

    def margins(self, signals: np.ndarray, max_calls: int | None = None) -> np.ndarray:
        """Exact margins under the heads: every suffix enumerated at every decision state; schedules over
        `max_calls` middle calls count as 0 tokens/s.

        signals: [R, 63, 17] (or [R, 31, 17]) -> [R, 31]."""
        r = len(signals)
        x = np.asarray(signals, np.float32)[:, QUERY_STATE].reshape(-1, NUM_SIGNALS)  # [R * 80, 17]
        tps = _tokens_per_s(self.predict(x, np.tile(QUERY_SUFFIX, (r, 1)))).reshape(2, r, NUM_QUERIES)
        tps = tps * feasible(max_calls)[QUERY_SCHEDULE][:, None, :]
        return _margins_from_queries(tps)

    def heldout_error(self, rounds: Rounds) -> dict[str, float]:
        """Per head, MSE over its examples divided by the variance of its target there (0 = perfect,
        1 = no better than predicting the mean); "mean" averages the four."""
        err = {}
        for h, (x, s, y) in _examples(rounds).items():
            mse = float(np.mean((self.predict(x, s)[h] - y) ** 2))
            err[h] = mse / max(float(np.var(y)), 1e-12)
        err["mean"] = float(np.mean([err[h] for h in HEADS]))
        return err


def _tokens_per_s(predicted: dict[str, np.ndarray]) -> np.ndarray:
    """HEADS -> [n] predictions -> [2, n] predicted tokens/s under (skip, call)."""
    return np.stack([predicted[f"accepted_{a}"] / (np.exp(predicted[f"loglat_{a}"]) / 1e3)
                     for a in ("skip", "call")])


def _examples(rounds: Rounds) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """HEADS -> (state signals [R * 80, 17], suffix [R * 80, 2D], target [R * 80])."""
    r = len(rounds)
    x = rounds.signals[:, QUERY_STATE].reshape(-1, NUM_SIGNALS)
    s = np.tile(QUERY_SUFFIX, (r, 1))
    out = {}
    for a, action in enumerate(("skip", "call")):
        sched = QUERY_SCHEDULE[a]
        out[f"accepted_{action}"] = (x, s, rounds.accepted[:, sched].reshape(-1))
        out[f"loglat_{action}"] = (x, s, np.log(rounds.latency_ms[:, sched]).reshape(-1))
    return out


def fit_value_heads(rounds: Rounds, subset=SIGNAL_NAMES, seed: int = 0, hidden: int = 64, epochs: int = 40,
                    lr: float = 3e-3, batch: int = 256) -> ValueHeads:
    """Fit the four heads (Adam, MSE on standardised targets); the same seed gives the same heads."""
    return fit_value_heads_each(rounds, [subset], seed, hidden, epochs, lr, batch)[0]


def fit_value_heads_each(rounds: Rounds, subsets, seed: int = 0, hidden: int = 64, epochs: int = 40,
                         lr: float = 3e-3, batch: int = 256) -> list[ValueHeads]:
    """fit_value_heads for each of `subsets` on the same rounds, every head of every subset trained at once
    (_train_together)."""
    states = rounds.signals[:, :NUM_DECISION_STATES].reshape(-1, NUM_SIGNALS)
    mean, std = _zscore(states)
    examples = _examples(rounds)
    out, nets, xs, ys, seeds = [], [], [], [], []
    for subset in subsets:
        heads = ValueHeads(informative(subset, states), mean, std, {}, {})
        for k, (h, (x, s, y)) in enumerate(examples.items()):
            mu, sd = float(y.mean()), max(float(y.std()), _STD_FLOOR)
            heads.target_norm[h] = (mu, sd)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + k)
                heads.nets[h] = _mlp(NUM_SIGNALS + SUFFIX_WIDTH, hidden)
            nets.append(heads.nets[h])
            xs.append(heads._inputs(x, s).numpy())
            ys.append((y - mu) / sd)
            seeds.append(seed + k)
        out.append(heads)
    _train_together(nets, xs, ys, seeds, epochs, lr, batch)
    return out


# -- which signals ------------------------------------------------------------------------------------

_CONTEXT = SIGNAL_NAMES[:4]
_PREFIX = SIGNAL_NAMES[4:11]
_TREE = SIGNAL_NAMES[11:]
CANDIDATE_SUBSETS = {
    "all": tuple(SIGNAL_NAMES),
    "context+prefix": tuple(_CONTEXT + _PREFIX),
    "tree+prefix": tuple(_PREFIX + _TREE),
    # Hardware-free: raw milliseconds differ per device; their ratio transfers better.
    "ratio-only": tuple(n for n in SIGNAL_NAMES if n not in ("t_tgt_ms", "t_mid_ms")),
}


@dataclass
class SubsetChoice:
    name: str
    subset: tuple[str, ...]
    heads: ValueHeads  # fitted on the train split with that subset
    errors: dict[str, dict[str, float]]  # candidate name -> ValueHeads.heldout_error


def choose_subset(train: Rounds, heldout: Rounds, candidates: dict[str, tuple[str, ...]] = CANDIDATE_SUBSETS,
                  seed: int = 0, **fit) -> SubsetChoice:
    """Fit value heads per candidate subset on `train`; keep the lowest mean held-out error (ties: the
    earlier candidate)."""
    if not len(train) or not len(heldout):
        raise ValueError(f"choose_subset needs rounds on both sides: train has {len(train)}, "
                         f"heldout {len(heldout)}")
    fitted = dict(zip(candidates, fit_value_heads_each(train, list(candidates.values()), seed=seed, **fit)))
    errors = {name: heads.heldout_error(heldout) for name, heads in fitted.items()}
    best = min(candidates, key=lambda n: errors[n]["mean"])
    return SubsetChoice(best, tuple(candidates[best]), fitted[best], errors)


# -- distillation -------------------------------------------------------------------------------------

def fit_scheduler(states_signals: np.ndarray, margins: np.ndarray, subset=SIGNAL_NAMES, seed: int = 0,
                  epochs: int = 60, lr: float = 3e-3, batch: int = 256) -> SchedulerMLP:
    """Regress the margin from the state alone (no suffix). states_signals: [n, 17], margins: [n].

    Margins are fitted in units of their standard deviation, then the last layer is scaled back, so the
    model outputs margins in tokens/s (the sign, which is all the scheduler uses, is unaffected)."""
    x = np.asarray(states_signals, np.float32)
    y = np.asarray(margins, np.float64)
    if x.ndim != 2 or x.shape[1] != NUM_SIGNALS or y.shape != (len(x),):
        raise ValueError(f"fit_scheduler needs states [n, {NUM_SIGNALS}] and margins [n], got {x.shape} "
                         f"and {y.shape}")
    scale = max(float(np.sqrt(np.mean(y**2))), _STD_FLOOR)
    subset = informative(subset, x)
    mean, std = _zscore(x)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SchedulerMLP(subset, mean, std)
    z = ((x - mean) / std * model.mask.numpy()).astype(np.float32)
    _train(model.net, z, y / scale, seed, epochs, lr, batch)
    with torch.no_grad():
        model.net[4].weight.mul_(scale)
        model.net[4].bias.mul_(scale)
    return model.eval()


def distil_scheduler(train: Rounds, heldout: Rounds, info: SchedulerInfo, seed: int = 0,
                     candidates: dict[str, tuple[str, ...]] = CANDIDATE_SUBSETS, value_fit: dict | None = None,
                     scheduler_fit: dict | None = None) -> tuple[LearnedScheduler, SubsetChoice]:
    """The whole offline stage on collected rounds: choose the subset by the value heads' held-out error,
    take exact margins under the chosen heads at every training decision state, distil them into the
    online MLP. `info.fit` gains the subset errors and the held-out agreement of the scheduler's
    decisions with the oracle's (sign of the margins from the recorded table)."""
    choice = choose_subset(train, heldout, candidates, seed, **(value_fit or {}))
    margins = choice.heads.margins(train.signals).reshape(-1)
    model = fit_scheduler(train.decision_signals(), margins, choice.subset, seed, **(scheduler_fit or {}))
    with torch.no_grad():
        predicted = model(torch.from_numpy(heldout.decision_signals())).numpy()
    oracle = oracle_margins(heldout.accepted, heldout.latency_ms).reshape(-1)
    fit = {**info.fit, "seed": seed, "subset": choice.name, "subset_errors": choice.errors,
           "heldout_sign_agreement": float(np.mean((predicted > 0) == (oracle > 0)))}
    info = SchedulerInfo(info.pair, info.cost_profile, info.split, fit)
    return LearnedScheduler(model, info), choice


# -- the value system online --------------------------------------------------------------------------

_CALLS_FRAC = SIGNAL_NAMES.index("calls_frac")


class ValuePlanner:
    """The value system as the online planner, the negative result the learned scheduler replaces.

    Before layer l it enumerates every suffix of the remaining D - l - 1 layers, predicts the accepted
    length and latency of the schedule under skip and under call, and calls iff the best tokens/s after
    calling beats the best after skipping: the sign of `ValueHeads.margins`, at 4 forwards of up to 16
    rows per decision. Not thread-safe (the inputs are preallocated): use one instance per thread."""

    name = "value-planner"
    needs_signals = True
    budgeted = True  # the engine caps its middle calls a round: max_calls where given, else b0 = floor(T_tgt / T_mid)
    stateless = True

    def __init__(self, heads: ValueHeads, max_calls: int | None = None):
        """`max_calls`: the per-round call budget; suffixes that would exceed it count as 0 tokens/s."""
        self.heads = heads
        self.max_calls = max_calls
        self._rows: list[np.ndarray] = []  # per layer [2**(D-l-1), 17 + 2D]: state columns, then the suffix
        for layer in range(D):
            suffixes = QUERY_SUFFIX[QUERY_STATE == state_index((0,) * layer)]  # the same at every prefix
            rows = np.zeros((len(suffixes), NUM_SIGNALS + SUFFIX_WIDTH), np.float32)
            rows[:, NUM_SIGNALS:] = suffixes
            self._rows.append(rows)
        self._inputs = [torch.from_numpy(rows) for rows in self._rows]  # views of the same memory

    def call_cap_at(self, budget: int) -> int | None:
        return self.max_calls  # what its plans assume, at whatever budget it was given

    def decide(self, signals: np.ndarray, layer: int) -> bool:  # signals: [17]
        if not 0 <= layer < D:
            raise ValueError(f"the value planner plans {D} drafting layers (0 .. {D - 1}), got layer {layer}: "
                             f"run it with depth {D}")
        self._rows[layer][:, :NUM_SIGNALS] = self.heads._standardise(signals)
        tps = _tokens_per_s(self.heads._forward(self._inputs[layer]))  # [2, suffixes]: (skip, call)
        if self.max_calls is not None:
            done = int(round(float(signals[_CALLS_FRAC]) * D))
            later = self._rows[layer][:, NUM_SIGNALS : NUM_SIGNALS + D].sum(1)
            tps = tps * (done + np.arange(2)[:, None] + later[None, :] <= self.max_calls)
        q = tps.max(axis=1)
        return bool(q[1] > q[0])
