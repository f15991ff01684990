"""The HTTP API speaks TLS with the gRPC port's certificate, and mutual TLS with its client CA."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest

from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading
from diffspec.settings import DiffSpecSettings
from gateway.http_api import HttpServer, create_app
from tests.gateway.test_security import make_pki


@pytest.mark.parametrize("mutual", [False, True])
def test_https_with_the_servers_certificate(tmp_path, mutual):
    pki = make_pki(tmp_path, "http")
    app = create_app(Loading("the gateway's engine"), DiffSpecSettings(), ServingMetrics())
    client_ca = str(pki["ca"]) if mutual else ""
    server = HttpServer(app, "127.0.0.1:0", 1.0, str(pki["cert"]), str(pki["key"]), client_ca)
    trusting = ssl.create_default_context(cafile=str(pki["ca"]))
    with_certificate = ssl.create_default_context(cafile=str(pki["ca"]))
    with_certificate.load_cert_chain(str(pki["cert"]), str(pki["key"]))

    async def go() -> None:
        address = await server.start()
        try:
            assert server.scheme == "https"
            async with httpx.AsyncClient(verify=with_certificate) as client:
                assert (await client.get(f"https://{address}/health")).status_code == 200
            failing = [httpx.AsyncClient(verify=ssl.create_default_context())]  # another CA: the system's
            if mutual:
                failing.append(httpx.AsyncClient(verify=trusting))  # no client certificate
            for client in failing:
                async with client:
                    with pytest.raises(httpx.TransportError):
                        await client.get(f"https://{address}/health")
            async with httpx.AsyncClient() as plain:
                with pytest.raises(httpx.TransportError):
                    await plain.get(f"http://{address}/health")
        finally:
            await server.stop()

    asyncio.run(go())
