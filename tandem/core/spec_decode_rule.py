"""Whether to speculate, and with how many drafts, decided per step from measured costs.

Drafts pay when the tokens a step emits grow faster than the step's time. A request in a
step with n drafts emits on average::

    E(n) = 1 + A(1) + ... + A(n),   A(j) = c[0] * c[1] * ... * c[j-1]

where `c[j]` is the conditional acceptance of draft j (accepted, given that drafts 0..j-1
were); the batch's tokens per second are proportional to `E(n) / T(n)`, `T(n)` the time of
a decode-only step with n drafts per request at this batch size. The rule picks the n in
0..k with the best rate; an n > 0 must beat plain decode by `margin`.

Few samples, shared strength (a 64-token run gives a batch of one a few dozen steps, too few
for each estimate to stand alone):

* Step time, per batch-size bucket (powers of two). Each n keeps a running mean of the time
  between consecutive step results (measured by the engine on the host) and its sample
  count. A verify step counts under the drafts its requests carried on average (rounded, at
  least 1), not the step's n: the scheduler holds requests whose drafts keep failing back
  from drafting, and a proposer may have fewer than n to offer, so a step decided with n
  drafts can cost much less than n's. Host timings on a shared machine carry one-sided
  noise (a pause only adds time), so a mean follows a faster sample at once and a slower
  one slowly (`smoothing` down, a quarter of it up, a slower sample clipped at twice the
  mean). Verify steps (n > 0) share one line ``T(n) = a + b n``, a least-squares fit over
  the measured n > 0 weighted by their samples (up to `max_time_weight` each), so an n
  never run has an estimate from its neighbours. With one n > 0 measured, the line goes
  through it and plain decode (a verify step grows about linearly in query tokens). Plain
  decode (n = 0) stands apart: it runs other graphs, and a verify step may cost a fixed
  amount more than the line down to n = 0 says. A verify step is never estimated cheaper
  than plain decode, and the slope never below zero.

      T ^                 x  measured verify arms (fitted: a + b n)
        |           x--x  o  plain decode (its own mean)
        |     x--x
        |  o
        +--+--+--+--+--+-> n
           0  1  2  3  4

* Acceptance, over all buckets: per position j, decayed counts of the requests that
  reached it (drafts 0..j-1 accepted, draft j scheduled) and of those whose draft j was
  accepted. A request scheduled with fewer drafts than its step's n counts as rejected at
  its first missing draft (a proposer with nothing to offer), and so does a request the
  scheduler holds back from drafting after its drafts kept failing, even in a step where no
  request drafted (at p = 0 the backoff would otherwise hide the rejections, and the rule
  kept deciding drafts nobody proposed while the proposer ran every step). `c[j]` is shrunk
  toward the pooled rate over all positions (`prior_weight` pseudo-trials), and the pooled
  rate toward 1 by half a pseudo-trial, so an unknown position takes its neighbours' rate
  and nothing measured means every draft accepted (an unknown bucket starts by
  speculating). Counts decay by `decay` per step that observes acceptance, so a change of
  acceptance shows within tens of steps.

Exploration: the arm not chosen is re-measured every `probe_interval` steps of the bucket,
for `probe_len` steps (the first sample after a switch is dropped: it pays the other arm's
pipeline bubble): plain decode when speculating; when not, the best n > 0 by the same rate
(at p = 0 that is n = 1, the cheapest verify step, which is enough: acceptance at a
position never exceeds the one before it, so E(n) <= 1 + n A(1)). The interval doubles, up
to `max_probe_interval`, while probes leave the decision as it was, and restarts at
`min_probe_interval` when one changes it. An untried n > 0 needs no probe of its own: it
has an estimate from the line, and running it once chosen measures it. A bucket that never
speculated is probed with k drafts first, one that never ran plain decode with none.

CUDA graphs: the decision is per step for the whole batch, so a step without drafts is a
plain decode (the decode graphs) and a step with drafts a verify step (the mixed-step graphs);
no graph is captured or dropped by the decision (vLLM's per-request dynamic threshold broke
full-graph capture). `disable_by_batch_size` stays a hard cap, applied before the rule.

No torch: the engine feeds it host times and the steps' outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput


@dataclass
class _Bucket:
    """What the rule knows at one batch-size bucket."""

    # Running mean of the step time (s) by drafts per request, None until measured, and the
    # samples behind each.
    times: list[float | None]
    counts: list[int]
    best: int = -1  # the last decision outside probes (-1: none yet)
    steps_since_probe: int = 0
    probe_interval: int = 0
    # T(n) for n = 0..k as `step_time` estimates it; None: a time changed since (recomputed
    # once per decision, not once per n asked).
    estimates: list[float | None] | None = None


@dataclass
class SpecRuleStats:
    """How the rule decided: steps by drafts per request (index n), and probes run."""

    steps_by_num_drafts: list[int] = field(default_factory=list)
    num_probes: int = 0

    def snapshot(self) -> SpecRuleStats:
        return SpecRuleStats(list(self.steps_by_num_drafts), self.num_probes)


def fit_line(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) of the weighted least-squares line y = a + b x through `points` (x, y, weight),
    the slope clipped at zero (then a is the weighted mean). One point: the flat line."""
    sw = sum(w for _, _, w in points)
    mx = sum(w * x for x, _, w in points) / sw
    my = sum(w * y for _, y, w in points) / sw
    sxx = sum(w * (x - mx) ** 2 for x, _, w in points)
    if sxx <= 0:
        return my, 0.0
    b = sum(w * (x - mx) * (y - my) for x, y, w in points) / sxx
    if b <= 0:
        return my, 0.0
    return my - b * mx, b


class SpeculationRule:
    """Decides each step's drafts per request, 0..k (see the module docstring).

    Call `decide(batch_size)` once per step before it is planned and `observe_output` with
    each step's result (or, directly: `observe_step` for a decode-only step's seconds since
    the previous result, `observe_acceptance` for a verify step). `propose` says whether
    the step just decided should have drafts proposed after it (the next step may use
    them)."""

    def __init__(
        self,
        num_spec_tokens: int,
        *,
        margin: float = 0.02,
        smoothing: float = 0.5,
        probe_len: int = 4,
        min_probe_interval: int = 8,
        max_probe_interval: int = 512,
        prior_weight: float = 8.0,
        decay: float = 0.97,
        max_time_weight: int = 8,
        skip_probe_gain: float = 0.25,
    ) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if prior_weight < 0 or max_time_weight < 1:
            raise ValueError("need prior_weight >= 0 and max_time_weight >= 1")
        if probe_len < 2 or not 1 <= min_probe_interval <= max_probe_interval:
            raise ValueError("need probe_len >= 2 and 1 <= min_probe_interval <= maximum")
        self.k = num_spec_tokens
        self.margin = margin
        self.smoothing = smoothing
        self.probe_len = probe_len
        self.min_probe_interval = min_probe_interval
        self.max_probe_interval = max_probe_interval
        self.prior_weight = prior_weight
        self.decay = decay
        self.max_time_weight = max_time_weight
        self.skip_probe_gain = skip_probe_gain
        # Decayed counts by draft position: requests that reached it, and of those, accepted.
        self.trials = [0.0] * num_spec_tokens
        self.accepted = [0.0] * num_spec_tokens
        # E(n) for n = 0..k; None: the counts changed since.
        self._expected: list[float] | None = None
        self._buckets: dict[int, _Bucket] = {}
        # Steps planned ahead (a probe), by drafts per request.
        self._plan: deque[int] = deque()
        self._plan_bucket = -1
        # Whether the last observed step had drafts (its successor's sample is dropped on a
        # switch); None before the first.
        self._last_kind: bool | None = None
        self.propose = True
        self.stats = SpecRuleStats([0] * (num_spec_tokens + 1))

    # ---- measurements ---------------------------------------------------------------------

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, ... share a bucket."""
        return max(batch_size - 1, 0).bit_length()

    def _bucket(self, batch_size: int) -> _Bucket:
        key = self.bucket_of(batch_size)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = _Bucket(
                [None] * (self.k + 1), [0] * (self.k + 1), probe_interval=self.min_probe_interval
            )
            self._buckets[key] = bucket
        return bucket

    def observe_step(self, batch_size: int, num_drafts: int, seconds: float) -> None:
        """A decode-only step of `batch_size` requests with up to `num_drafts` drafts each
        produced its tokens `seconds` after the previous step's."""
        kind = num_drafts > 0
        switched = self._last_kind is not None and kind != self._last_kind
        self._last_kind = kind
        if switched or seconds <= 0:
            return
        bucket = self._bucket(batch_size)
        times = bucket.times
        n = min(num_drafts, self.k)
        bucket.counts[n] += 1
        bucket.estimates = None
        old = times[n]
        if old is None:
            times[n] = seconds
        elif seconds < old:
            times[n] = old + self.smoothing * (seconds - old)
        else:
            # Slower: likely noise (another process, a collection); moves the mean slowly.
            times[n] = old + 0.25 * self.smoothing * (min(seconds, 2.0 * old) - old)

    def observe_output(
        self, so: SchedulerOutput, result: ModelRunnerOutput, seconds: float | None
    ) -> None:
        """One step's result, `seconds` after the previous step's (None: not a step's cost):
        its time if every request decoded (1 + its drafts; timed under the drafts a request
        had on average, rounded, at least 1 in a verify step), its acceptance if it verified.
        A request the scheduler held back from drafting (`spec_backoff_req_ids`: its drafts
        kept failing) counts as a rejected first draft, in a verify step or a plain one: the
        backoff hides exactly the rejections that tell the rule to stop."""
        spec = so.scheduled_spec_decode_tokens
        counts = so.num_scheduled_tokens
        num_drafts = max((len(d) for d in spec.values()), default=0)
        total_drafts = sum(len(d) for d in spec.values())
        decode_only = so.total_num_scheduled_tokens == len(counts) + total_drafts
        if seconds is not None and decode_only and counts:
            # A verify step's cost follows its query tokens (see the module docstring).
            timed = max(1, round(total_drafts / len(counts))) if total_drafts else 0
            self.observe_step(len(counts), timed, seconds)
        backoff = so.spec_backoff_req_ids
        if not spec and not backoff:
            return
        num_requests = 0
        accepted = [0] * max(num_drafts, 1)
        for req_id, sampled in zip(result.req_ids, result.sampled_token_ids, strict=True):
            if not sampled or (not spec and req_id not in backoff):
                continue
            num_requests += 1
            drafts = spec.get(req_id)
            if drafts:
                for j in range(min(len(sampled) - 1, len(drafts))):
                    accepted[j] += 1
        self.observe_acceptance(num_requests, accepted)

    def observe_acceptance(self, num_requests: int, accepted_per_pos: Sequence[int]) -> None:
        """One verify step: of its `num_requests` sampled requests, `accepted_per_pos[j]` had
        drafts 0..j accepted (so it never exceeds the entry before it); positions past the
        step's most drafts are not trials."""
        if num_requests <= 0:
            return
        self._expected = None
        for j in range(self.k):
            self.trials[j] *= self.decay
            self.accepted[j] *= self.decay
        reached = float(num_requests)
        for j, accepted in enumerate(accepted_per_pos[: self.k]):
            accepted = min(float(accepted), reached)
            self.trials[j] += reached
            self.accepted[j] += accepted
            reached = accepted

    def conditional_acceptance(self) -> list[float]:
        """c[j]: draft j's acceptance given drafts 0..j-1 accepted, shrunk toward the pooled
        rate (which is shrunk toward 1 by half a pseudo-trial)."""
        pooled = (sum(self.accepted) + 0.5) / (sum(self.trials) + 0.5)
        m = self.prior_weight
        return [(a + m * pooled) / (t + m) for a, t in zip(self.accepted, self.trials, strict=True)]

    def expected_tokens(self, num_drafts: int) -> float:
        """E(n): tokens a request emits in a step with n drafts."""
        if self._expected is None:
            expected, total, reach = [1.0], 1.0, 1.0
            for c in self.conditional_acceptance():
                reach *= c
                total += reach
                expected.append(total)
            self._expected = expected
        return self._expected[min(num_drafts, self.k)]

    def step_time(self, batch_size: int, num_drafts: int) -> float | None:
        """T(n) at this batch size: plain decode's mean for n = 0, else the verify line at n
        (None: not enough measured)."""
        bucket = self._bucket(batch_size)
        if bucket.estimates is None:
            bucket.estimates = self._estimate_times(bucket)
        return bucket.estimates[min(num_drafts, self.k)]

    def _estimate_times(self, bucket: _Bucket) -> list[float | None]:
        """`step_time` for n = 0..k at `bucket` (see the module docstring): one line fit."""
        times = bucket.times
        t0 = times[0]
        points = [
            (float(n), t, float(min(bucket.counts[n], self.max_time_weight)))
            for n, t in enumerate(times)
            if n and t is not None
        ]
        if not points:
            return [t0] + [None] * self.k
        if len(points) == 1 and t0 is None:
            only = int(points[0][0])
            return [None] + [points[0][1] if n == only else None for n in range(1, self.k + 1)]
        if len(points) == 1:
            points.append((0.0, t0, 1.0))
        a, b = fit_line(points)
        line = [a + b * n for n in range(1, self.k + 1)]
        return [t0] + (line if t0 is None else [max(t, t0) for t in line])

    # ---- the decision ---------------------------------------------------------------------

    def best(self, batch_size: int) -> int:
        """The drafts per request with the best estimated rate (-1: not enough measured)."""
        t0 = self.step_time(batch_size, 0)
        n = self.best_drafting(batch_size)
        t = self.step_time(batch_size, n)
        if t0 is None or t is None:
            return -1
        return n if self.expected_tokens(n) / t > (1.0 + self.margin) / t0 else 0

    def best_drafting(self, batch_size: int) -> int:
        """The n > 0 with the best estimated rate (k while the step times are unknown)."""
        best, best_rate = self.k, 0.0
        for n in range(1, self.k + 1):
            t = self.step_time(batch_size, n)
            if t is None or t <= 0:
                return self.k
            rate = self.expected_tokens(n) / t
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def decide(self, batch_size: int) -> int:
        """Drafts per request for the step about to be planned, 0..k."""
        key = self.bucket_of(batch_size)
        if self._plan and self._plan_bucket != key:
            self._plan.clear()  # the batch moved to another bucket: its probe is moot
        if self._plan:
            n = self._plan.popleft()
            # After the probe's last step the bucket's decision resumes.
            upcoming = self._plan[0] if self._plan else self._bucket(batch_size).best
        else:
            n = upcoming = self._choose(batch_size)
        # Proposals after this step feed the next one: wanted when it may take drafts.
        self.propose = upcoming > 0
        self.stats.steps_by_num_drafts[n] += 1
        return n

    def _choose(self, batch_size: int) -> int:
        bucket = self._bucket(batch_size)
        key = self.bucket_of(batch_size)
        times = bucket.times
        if all(t is None for t in times[1:]):
            return self._probe(key, self.k)  # never speculated here: measure it
        if times[0] is None:
            return self._probe(key, 0)
        best = self.best(batch_size)
        if best != bucket.best:
            if bucket.best >= 0 and (best > 0) != (bucket.best > 0):
                bucket.probe_interval = self.min_probe_interval
            bucket.best = best
            bucket.steps_since_probe = 0
        bucket.steps_since_probe += 1
        if bucket.steps_since_probe >= bucket.probe_interval:
            bucket.steps_since_probe = 0
            bucket.probe_interval = min(2 * bucket.probe_interval, self.max_probe_interval)
            if best > 0 and self._far_ahead(batch_size, best):
                return best  # plain decode well measured and far behind: no probe needed
            return self._probe(key, 0 if best > 0 else self.best_drafting(batch_size))
        return best

    def _far_ahead(self, batch_size: int, num_drafts: int) -> bool:
        """Whether n drafts beat plain decode by `skip_probe_gain` or more, with plain
        decode's time from `probe_len - 1` samples or more (one probe's worth)."""
        bucket = self._bucket(batch_size)
        t0, t = bucket.times[0], self.step_time(batch_size, num_drafts)
        if t0 is None or t is None or bucket.counts[0] < self.probe_len - 1:
            return False
        return self.expected_tokens(num_drafts) / t >= (1.0 + self.skip_probe_gain) / t0

    def _probe(self, key: int, num_drafts: int) -> int:
        """Run `probe_len` steps with `num_drafts` (the first of them returned now). A probe
        of drafts starts with one plain step that proposes them."""
        self.stats.num_probes += 1
        self._plan_bucket = key
        if num_drafts > 0 and self._last_kind is not True:
            self._plan.extend([num_drafts] * self.probe_len)
            return 0
        self._plan.extend([num_drafts] * (self.probe_len - 1))
        return num_drafts
