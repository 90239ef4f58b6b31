"""The chaos soak's requests: a seeded mix (greedy and seeded sampling, some with stop strings),
each with its reference output from the in-process engine, and the rule a stream is held to."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from proto import pdserve_pb2 as pb
from protocol.sampling import SamplingParams
from router.config.schema import ClusterConfig

NUM_SPECS = 192  # distinct requests; the soak cycles through them under fresh request ids
REFERENCE_BATCH = 16  # 16 x (120 + 48) tokens fit the 256-block pool: no preemption in the reference
# float32-exact values, so the proto's float fields carry exactly what the reference used
TEMPERATURES, TOP_PS, TOP_KS = (0.5, 0.75, 1.0), (1.0, 0.875, 0.75), (0, 0, 40)


@dataclass(frozen=True)
class Spec:
    prompt: list[int]
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)  # the reference output
    text: str = ""
    finish: str = ""


@dataclass
class Outcome:
    """What one stream delivered: `status` is a gRPC code name, "CANCELLED_BY_CLIENT" or "HUNG"."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = ""
    migrations: int = 0
    status: str = "OK"


def random_spec(rng: random.Random) -> Spec:
    prompt = [rng.randrange(10, 2000) for _ in range(rng.randint(4, 120))]
    sampled = {} if rng.random() < 0.5 else {
        "temperature": rng.choice(TEMPERATURES), "top_p": rng.choice(TOP_PS), "top_k": rng.choice(TOP_KS),
        "seed": rng.randrange(2**31)}
    return Spec(prompt, SamplingParams(max_tokens=rng.randint(8, 48), ignore_eos=rng.random() < 0.5, **sampled))


def reference(engine: LLMEngine, specs: list[Spec]) -> list[Spec]:
    """Each spec with the tokens, text and finish reason the engine alone produces for it."""
    done = []
    for start in range(0, len(specs), REFERENCE_BATCH):
        batch = {f"ref-{start + i}": s for i, s in enumerate(specs[start:start + REFERENCE_BATCH])}
        tokens, text, finish = {rid: [] for rid in batch}, dict.fromkeys(batch, ""), {}
        for rid, s in batch.items():
            engine.add_request(rid, prompt_token_ids=s.prompt, sampling=s.sampling)
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.token_ids
                text[o.request_id] += o.text
                if o.finished:
                    finish[o.request_id] = o.finish_reason.public  # as the client reads it over gRPC
        done += [Spec(s.prompt, s.sampling, tokens[rid], text[rid], finish[rid]) for rid, s in batch.items()]
    return done


def with_stop_string(spec: Spec, rng: random.Random) -> Spec:
    """The spec with a 2-4 character stop string cut from its reference text (so it hits)."""
    size = rng.randint(2, 4)
    starts = [i for i in range(len(spec.text) - size + 1)
              if "\ufffd" not in spec.text[i:i + size] and spec.text[i:i + size].strip()]
    if not starts:
        return spec
    i = rng.choice(starts)
    return Spec(spec.prompt, dataclasses.replace(spec.sampling, stop=(spec.text[i:i + size],)))


def make_specs(cfg: ClusterConfig, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    engine = LLMEngine(cfg.engine_config(cfg.decode))
    specs = reference(engine, [random_spec(rng) for _ in range(NUM_SPECS)])
    stopped = [i for i in range(NUM_SPECS) if rng.random() < 0.25]
    redone = reference(engine, [with_stop_string(specs[i], rng) for i in stopped])
    for i, spec in zip(stopped, redone, strict=True):
        specs[i] = spec
    return specs


def to_proto(p: SamplingParams) -> pb.SamplingParams:
    sampled = {} if p.greedy else {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                                   "seed": p.seed}
    return pb.SamplingParams(max_tokens=p.max_tokens, ignore_eos=p.ignore_eos, stop=list(p.stop), **sampled)


def mismatch(spec: Spec, got: Outcome) -> str | None:
    """Why `got` disagrees with the reference; a stream cut short must be a prefix of it."""
    if got.status == "OK":
        if (got.tokens, got.text, got.finish) != (spec.tokens, spec.text, spec.finish):
            return f"got {got.tokens} {got.text!r} {got.finish!r}, expected {spec.tokens} {spec.text!r} {spec.finish!r}"
        return None
    if got.tokens != spec.tokens[:len(got.tokens)] or not spec.text.startswith(got.text):
        return f"{got.status} after {got.tokens} {got.text!r}, not a prefix of {spec.tokens} {spec.text!r}"
    return None
