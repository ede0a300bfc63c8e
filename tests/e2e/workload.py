"""Shared-prefix workload and engine-metric helpers, used by the real-vLLM e2e suite
(tests/e2e/test_real_vllm.py) and the routing-quality peer benchmark
(benches/routing_peers.py). Stdlib only.

The workload: `groups` long shared system prompts (~`prefix_words` words each),
each request = one of them + a short unique question, in a seeded shuffled order
so every group recurs `per_group` times; streamed chat completions with a small
`max_tokens`. Client-side TTFT is the time to the first content chunk.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

WORDS = (
    "alpha bravo delta gamma omega sigma kappa lemon mango pearl river stone cloud ember "
    "frost grove haven ivory jolly karma lunar maple noble ocean prism quartz raven solar "
    "tiger umbra velvet willow xenon yield zephyr amber basil cedar dune eagle fable "
    "garnet harbor island jasper kernel lotus meadow nectar orbit pepper quill ridge "
    "saffron thistle union vessel walnut yonder zenith"
).split()


def prefix_text(seed: int, group: int, words: int) -> str:
    rng = random.Random(seed * 1_000_003 + group)
    return f"[doc {seed}-{group}] " + " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Workload:
    seed: int = 1
    groups: int = 8
    per_group: int = 8
    prefix_words: int = 520
    max_tokens: int = 4
    # Which prefixes (prefix_text ids) to use; default range(groups).
    group_ids: list[int] | None = None

    def requests(self) -> list[dict]:
        rng = random.Random(self.seed)
        ids = self.group_ids if self.group_ids is not None else list(range(self.groups))
        order = [g for g in ids for _ in range(self.per_group)]
        rng.shuffle(order)
        out = []
        for i, g in enumerate(order):
            out.append({
                "group": g,
                "messages": [
                    {"role": "system", "content": prefix_text(self.seed, g, self.prefix_words)},
                    {"role": "user", "content": f"question {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}?"},
                ],
            })
        return out


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0

    def summary(self) -> dict:
        def pct(xs, q):
            if not xs:
                return float("nan")
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
        return {
            "n": len(self.ttft), "errors": len(self.errors),
            "ttft_p50_ms": pct(self.ttft, 0.5) * 1e3, "ttft_p99_ms": pct(self.ttft, 0.99) * 1e3,
            "ttft_mean_ms": (statistics.fmean(self.ttft) * 1e3) if self.ttft else float("nan"),
            "e2e_p50_ms": pct(self.e2e, 0.5) * 1e3, "wall_s": self.wall,
        }


def stream_chat(base_url: str, model: str, messages: list[dict], max_tokens: int,
                timeout: float = 120.0, headers: dict | None = None) -> tuple[float, float, int]:
    """One streamed chat completion; returns (ttft_s, e2e_s, chunks with a choice)."""
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "temperature": 0,
    }).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.monotonic()
    ttft = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"error event: {obj['error']}")
            # First token: the first chunk with a choice. vLLM sends the role chunk when
            # the first token comes out of prefill; with a random-weight model a token can
            # also decode to no text yet (a partial UTF-8 sequence), so content may be "".
            if obj.get("choices"):
                chunks += 1
                if ttft is None:
                    ttft = time.monotonic() - t0
    e2e = time.monotonic() - t0
    if ttft is None:
        raise RuntimeError("stream ended without a choice")
    return ttft, e2e, chunks


def run_workload(base_url: str, model: str, wl: Workload, concurrency: int = 2,
                 deadline_s: float = 600.0, headers: dict | None = None) -> Result:
    """Closed loop: `concurrency` clients take the next request in order. Bounded by
    `deadline_s` (requests not started by then are counted as errors)."""
    reqs = wl.requests()
    res = Result()
    lock = threading.Lock()
    it = iter(reqs)
    end = time.monotonic() + deadline_s

    def client() -> None:
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            if time.monotonic() > end:
                with lock:
                    res.errors.append("deadline")
                continue
            try:
                ttft, e2e, _ = stream_chat(base_url, model, nxt["messages"], wl.max_tokens,
                                           headers=headers)
                with lock:
                    res.ttft.append(ttft)
                    res.e2e.append(e2e)
            except (OSError, RuntimeError, ValueError) as e:
                with lock:
                    res.errors.append(repr(e)[:300])

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as ex:
        for f in [ex.submit(client) for _ in range(concurrency)]:
            f.result()
    res.wall = time.monotonic() - t0
    return res


# ---------------------------------------------------------------- Prometheus text

def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    """Every sample of metric `name` (exact name, may contain ':') as (labels, value)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name):]
        labels: dict = {}
        if rest.startswith("{"):
            close = rest.index("}")
            body = rest[1:close]
            rest = rest[close + 1:]
            # label values may contain commas only inside quotes; split carefully
            i = 0
            while i < len(body):
                eq = body.index("=", i)
                key = body[i:eq].strip().lstrip(",").strip()
                assert body[eq + 1] == '"', line
                j = eq + 2
                val = []
                while body[j] != '"':
                    if body[j] == "\\":
                        j += 1
                    val.append(body[j])
                    j += 1
                labels[key] = "".join(val)
                i = j + 1
                while i < len(body) and body[i] in ", ":
                    i += 1
        elif not rest.startswith(" "):
            continue  # a longer name sharing this prefix
        out.append((labels, float(rest.split()[0])))
    return out


def total(text: str, name: str, **match) -> float:
    return sum(v for lab, v in samples(text, name) if all(lab.get(k) == w for k, w in match.items()))


def prefix_counters(metrics_urls: list[str]) -> tuple[float, float]:
    """(hits, queries) summed over engines, from vLLM's prefix-cache counters (tokens)."""
    hits = queries = 0.0
    for u in metrics_urls:
        t = scrape(u)
        hits += total(t, "vllm:prefix_cache_hits_total")
        queries += total(t, "vllm:prefix_cache_queries_total")
    return hits, queries


def requests_per_engine(metrics_urls: list[str]) -> list[float]:
    return [total(scrape(u), "vllm:request_success_total") for u in metrics_urls]


def hit_ratio_during(metrics_urls: list[str], fn) -> tuple[float, object]:
    h0, q0 = prefix_counters(metrics_urls)
    out = fn()
    h1, q1 = prefix_counters(metrics_urls)
    return ((h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")), out


def wait_http_ok(url: str, deadline_s: float, alive=lambda: True, what: str = "") -> None:
    """Poll `url` until it answers 200; raise if `alive()` turns false or time runs out."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        if not alive():
            raise RuntimeError(f"{what or url}: process exited before becoming ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError) as e:
            last = e
        time.sleep(0.25)  # poll interval, not synchronisation
    raise RuntimeError(f"{what or url}: not ready after {deadline_s:.0f}s (last: {last!r})")
