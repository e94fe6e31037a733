"""The gRPC door over TLS, from the front door's config (`grpc.tls_cert_file`,
`grpc.tls_key_file`), against a self-signed certificate for 127.0.0.1 made here."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from router.client import AsyncClient, ClientError
from router.config import FrontDoorConfig
from router.grpc_server import start_grpc_server
from router.tokenizer import TextCodec
from tests.router.test_frontdoor import ScriptedCluster, door_over

CLUSTER = {"model": "m", "spec_policy": "none"}


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files in `folder`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / f"{name}.crt", folder / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def _config(**grpc: Any) -> FrontDoorConfig:
    return FrontDoorConfig.from_args({"cluster": CLUSTER, "grpc": {"port": 0, **grpc}})


def test_a_tls_door_serves_a_client_that_trusts_its_certificate_only(
    codec: TextCodec, tmp_path: Path
) -> None:
    cert, key = _self_signed(tmp_path, "door")
    config = _config(tls_cert_file=str(cert), tls_key_file=str(key))

    async def call() -> None:
        door = door_over(ScriptedCluster(), codec)
        server = await start_grpc_server(door, "127.0.0.1", 0, tls=config.grpc_tls())
        target = f"127.0.0.1:{server.port}"
        try:
            trusted = cert.read_bytes()
            async with AsyncClient(target, tls=True, root_certificates=trusted) as client:
                assert (await client.cluster_status(timeout_s=10)).model == "demo"
            for kwargs in ({}, {"tls": True, "root_certificates": _other_ca(tmp_path)}):
                async with AsyncClient(target, timeout_s=5, **kwargs) as client:
                    with pytest.raises(ClientError) as info:
                        await client.cluster_status()
                    assert info.value.code is grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop()

    asyncio.run(call())


def _other_ca(folder: Path) -> bytes:
    return _self_signed(folder, "other")[0].read_bytes()


def test_tls_files_are_checked_naming_the_field(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path, "door")
    _, other_key = _self_signed(tmp_path, "other")
    with pytest.raises(ValueError, match=r"tls_cert_file and grpc\.tls_key_file go together"):
        _config(tls_cert_file=str(cert))
    with pytest.raises(ValueError, match="grpc must be a mapping with host, port, tls_cert_file"):
        _config(tls_ca_file=str(cert))
    missing = _config(tls_cert_file=str(tmp_path / "nope.crt"), tls_key_file=str(key))
    with pytest.raises(ValueError, match=r"grpc.tls_cert_file '.*nope.crt': No such file"):
        missing.grpc_tls()
    (tmp_path / "notes.txt").write_text("not a key")
    garbled = _config(tls_cert_file=str(cert), tls_key_file=str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match=r"grpc.tls_key_file '.*notes.txt' holds no PEM block"):
        garbled.grpc_tls()
    mismatched = _config(tls_cert_file=str(cert), tls_key_file=str(other_key))
    with pytest.raises(ValueError, match="do not load as a certificate and its key"):
        mismatched.grpc_tls()
