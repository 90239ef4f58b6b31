"""Helpers for end-to-end tests: configs on free ports, a blocking gRPC client, references."""

from __future__ import annotations

import dataclasses
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.config.loader import parse_config
from router.config.schema import ClusterConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_config(model_path: str, **overrides) -> ClusterConfig:
    raw = {
        "model": {"path": model_path},
        "router": {"port": free_port(), "metrics_port": 0, "shutdown_grace_s": 5},
        "prefill": {"replicas": 1, "num_cpus": 0.5},
        "decode": {"replicas": 1, "num_cpus": 0.5},
        "kv_cache": {"block_size": 16, "num_blocks": 256},
        "kv_transfer": {"timeout_s": 10},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return parse_config(raw)


def with_port(cfg: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, port=free_port()))


class Client:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)

    def stream(self, prompt_ids: list[int] | None = None, prompt: str = "", **sampling):
        req = pb.GenerateRequest(prompt=prompt, prompt_token_ids=prompt_ids or [],
                                 sampling=pb.SamplingParams(**sampling))
        return self.gen.Generate(req, timeout=120)

    def tokens(self, prompt_ids: list[int], **sampling) -> tuple[list[int], pb.GenerateResponse]:
        out, last = [], None
        for msg in self.stream(prompt_ids, **sampling):
            out.extend(msg.token_ids)
            last = msg
        return out, last

    def many(self, prompts: list[list[int]], **sampling) -> list[list[int]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            return [r[0] for r in pool.map(lambda p: self.tokens(p, **sampling), prompts)]

    def status(self) -> pb.StatusResponse:
        return self.admin.Status(pb.StatusRequest(), timeout=30)

    def close(self) -> None:
        self.channel.close()
