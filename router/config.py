"""The front door's configuration: the Ray Serve application args, typed and validated.

Args shape (deploy/serve-*.yaml): {"cluster": {ClusterConfig fields}, "http": {"host", "port"},
"grpc": {"host", "port", "tls_cert_file", "tls_key_file"}, "api_keys_file": path | null,
"default_slo": tier name | {"ttft_ms", "tpot_ms"} | null, "default_chat_max_tokens": int,
"tool_call_parser": name | null, "reasoning_parser": name | {"start", "end", "starts_open"} |
null}.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from replica.planner.config import check_fraction, check_int, check_text
from replica.request import SLO, check_in_vocab
from router.errors import BadRequest
from router.openai_schema import MAX_REQUEST_MB, tier_slo
from router.reasoning import ReasoningParser, reasoning_parser
from router.tokenizer import TextCodec
from router.tool_parsers import PARSERS, ToolParser

FALLBACK_SLO = SLO(ttft_ms=5000.0, tpot_ms=500.0)
"""The default SLO when the config names none and defines no tiers: loose enough for CPU."""
TOP_LEVEL = {
    "cluster",
    "http",
    "grpc",
    "api_keys_file",
    "default_slo",
    "default_chat_max_tokens",
    "max_request_mb",
    "tool_call_parser",
    "reasoning_parser",
}


@dataclass(frozen=True)
class FrontDoorConfig:
    cluster: ClusterConfig
    http_host: str | None = None
    """Only checked and logged: Ray Serve's http_options decide where HTTP listens."""
    http_port: int = 8000
    grpc_host: str | None = None
    """None: 127.0.0.1 without API keys, 0.0.0.0 with them."""
    grpc_port: int = 50051
    grpc_tls_cert_file: str | None = None
    """With `grpc_tls_key_file`: gRPC serves TLS with this PEM certificate (chain), so API
    keys do not cross the network in the clear; None: plaintext."""
    grpc_tls_key_file: str | None = None
    api_keys_file: str | None = None
    default_slo: SLO | str = FALLBACK_SLO
    """Used when a request names no SLO (body, headers) and is not flex: explicit numbers, or
    a tier's name (`slos` resolves it)."""
    default_chat_max_tokens: int = 256
    max_request_mb: float = MAX_REQUEST_MB
    """The largest HTTP body and gRPC message the doors read, in MiB: a larger one is refused
    unread (413, RESOURCE_EXHAUSTED) rather than parsed on the door's event loop."""
    tool_call_parser: str | None = None
    """How the served model writes tool calls (router.tool_parsers.PARSERS: hermes,
    llama3_json), which `tool_choice: "auto"` needs; None refuses "auto"."""
    reasoning_parser: ReasoningParser | None = None
    """How the served model marks its thinking (router.reasoning): chat responses give it
    as `reasoning_content`, apart from the answer; None: all of it is content."""

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise ValueError(f"{name} must be an integer in [0, 65535], got {port!r}")
        for name in (
            "http_host",
            "grpc_host",
            "api_keys_file",
            "grpc_tls_cert_file",
            "grpc_tls_key_file",
        ):
            check_text(name, getattr(self, name), optional=True)
        if (self.grpc_tls_cert_file is None) != (self.grpc_tls_key_file is None):
            raise ValueError(
                "grpc.tls_cert_file and grpc.tls_key_file go together: give both for TLS, "
                "or neither"
            )
        check_int("default_chat_max_tokens", self.default_chat_max_tokens)
        check_fraction("max_request_mb", self.max_request_mb, low=0.01, high=2047.0)
        parser = self.tool_call_parser
        if parser is not None and (not isinstance(parser, str) or parser not in PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(PARSERS)} or null, "
                f"got {self.tool_call_parser!r}"
            )

    def grpc_tls(self) -> tuple[bytes, bytes] | None:
        """The gRPC door's (certificate, key) PEM, read now; None: plaintext."""
        if self.grpc_tls_cert_file is None or self.grpc_tls_key_file is None:
            return None
        pems = []
        for name, path in (
            ("grpc.tls_cert_file", self.grpc_tls_cert_file),
            ("grpc.tls_key_file", self.grpc_tls_key_file),
        ):
            try:
                pems.append(Path(path).read_bytes())
            except OSError as exc:
                raise ValueError(f"{name} {path!r}: {exc.strerror}") from None
            if b"-----BEGIN " not in pems[-1]:
                raise ValueError(f"{name} {path!r} holds no PEM block")
        try:  # grpc would only say so once the cluster is up
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.grpc_tls_cert_file, self.grpc_tls_key_file)
        except ssl.SSLError as exc:
            raise ValueError(
                f"grpc.tls_cert_file {self.grpc_tls_cert_file!r} and grpc.tls_key_file "
                f"{self.grpc_tls_key_file!r} do not load as a certificate and its key: {exc}"
            ) from None
        return pems[0], pems[1]

    @property
    def tool_parser(self) -> ToolParser | None:
        return None if self.tool_call_parser is None else PARSERS[self.tool_call_parser]

    def slos(self, codec: TextCodec) -> tuple[dict[str, SLO], SLO]:
        """The tiers' SLOs by name and the default SLO: a tier's stages are parsed as a
        request's (`until` needs the tokenizer), a bad one named with its tier here rather
        than in every request that uses it."""
        tiers = {}
        for tier in self.cluster.tiers:
            try:
                slo = tier_slo(tier.ttft_ms, tier.tpot_ms, tier.stages, codec)
                check_in_vocab("slo.stages[].end_token_ids", slo.end_token_ids, codec.model_vocab)
            except BadRequest as exc:
                raise ValueError(f"tiers[{tier.name}]: {exc.message}") from None
            except ValueError as exc:
                raise ValueError(f"tiers[{tier.name}]: {exc}") from None
            tiers[tier.name] = slo
        default = self.default_slo
        return tiers, tiers[default] if isinstance(default, str) else default

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> FrontDoorConfig:
        unknown = sorted(set(args) - TOP_LEVEL)
        if unknown:
            raise ValueError(f"unknown front door arg(s): {', '.join(unknown)}")
        cluster = ClusterConfig.from_dict(args.get("cluster") or {})
        http = _section(args, "http", ("host", "port"))
        grpc = _section(args, "grpc", ("host", "port", "tls_cert_file", "tls_key_file"))
        return cls(
            cluster=cluster,
            http_host=http.get("host"),
            http_port=http.get("port", 8000),
            grpc_host=grpc.get("host"),
            grpc_port=grpc.get("port", 50051),
            grpc_tls_cert_file=grpc.get("tls_cert_file"),
            grpc_tls_key_file=grpc.get("tls_key_file"),
            api_keys_file=args.get("api_keys_file"),
            default_slo=_default_slo(args.get("default_slo"), cluster),
            default_chat_max_tokens=args.get("default_chat_max_tokens", 256),
            max_request_mb=args.get("max_request_mb", MAX_REQUEST_MB),
            tool_call_parser=args.get("tool_call_parser"),
            reasoning_parser=reasoning_parser(args.get("reasoning_parser")),
        )


def _section(args: Mapping[str, Any], name: str, fields: tuple[str, ...]) -> dict[str, Any]:
    section = args.get(name) or {}
    if not isinstance(section, dict) or set(section) - set(fields):
        raise ValueError(f"{name} must be a mapping with {', '.join(fields)} only, got {section!r}")
    return section


def _default_slo(raw: object, cluster: ClusterConfig) -> SLO | str:
    """A named tier, explicit numbers, or else the first configured tier (else FALLBACK_SLO)."""
    if isinstance(raw, str):
        return cluster.tier(raw).name
    if isinstance(raw, dict):
        if set(raw) != {"ttft_ms", "tpot_ms"}:
            raise ValueError(f"default_slo must have ttft_ms and tpot_ms, got {sorted(raw)}")
        return SLO(raw["ttft_ms"], raw["tpot_ms"])
    if raw is not None:
        raise ValueError(f"default_slo must be a tier name or {{ttft_ms, tpot_ms}}, got {raw!r}")
    if cluster.tiers:
        return cluster.tiers[0].name
    return FALLBACK_SLO
