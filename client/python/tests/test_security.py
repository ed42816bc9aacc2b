"""The client against a tinkerd with API keys and mutual TLS: a key is a tenant that sees only its
own models; a missing key, or a client without a certificate, is refused with a clear error."""

import subprocess

import grpc
import pytest

import tinkerd
from conftest import Server

PKI = """set -e
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext
printf 'extendedKeyUsage=clientAuth\\n' > client.ext
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca -keyout ca.key -out ca.pem
sign() {
  openssl req -newkey rsa:2048 -nodes -subj /CN=$1 -keyout $1.key -out $1.csr
  openssl x509 -req -in $1.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile $2 \\
    -out $1.pem
}
sign server server.ext
sign client client.ext
"""


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    subprocess.run(["sh", "-c", PKI], cwd=d, check=True, capture_output=True)
    (d / "keys").write_text("# tenant key\nalice tml-alice-0123456789\nbob tml-bob-0123456789ab\n")
    server = Server(64, f"--api_keys_file={d / 'keys'}", f"--tls_cert={d / 'server.pem'}",
                    f"--tls_key={d / 'server.key'}", f"--tls_client_ca={d / 'ca.pem'}")
    server.pki = d
    yield server
    server.stop()


def connect(server, api_key, client_cert=True, **kw):
    pki = server.pki
    cert = dict(client_cert=(pki / "client.pem").read_bytes(),
                client_key=(pki / "client.key").read_bytes()) if client_cert else {}
    return tinkerd.Connection(server.target.replace("127.0.0.1", "localhost"), api_key=api_key,
                              tls=True, root_certs=(pki / "ca.pem").read_bytes(), **cert, **kw)


def test_a_key_is_a_tenant(secure):
    with connect(secure, "tml-alice-0123456789") as alice, connect(secure, "tml-bob-0123456789ab") as bob:
        trainer = alice.create_training_client(lora_rank=4)
        d = tinkerd.datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0])
        assert trainer.forward_backward([d]).result().metrics["num_tokens:sum"] == 3
        assert [m.model_id for m in alice.list_models()] == [trainer.model_id]
        assert bob.list_models() == []
        with pytest.raises(tinkerd.TinkerdError) as error:
            bob.get_info(trainer.model_id)
        assert error.value.code == grpc.StatusCode.NOT_FOUND
        # Bob cannot sample Alice's weights either.
        with pytest.raises(tinkerd.TinkerdError) as error:
            bob.sampling_client(model_id=trainer.model_id).sample([1, 2], max_tokens=1).result()
        assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_no_key_or_no_certificate_is_refused(secure):
    with connect(secure, None) as anonymous:
        with pytest.raises(tinkerd.TinkerdError) as error:
            anonymous.list_models()
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "x-api-key" in error.value.message
    with connect(secure, "tml-alice-0123456789", client_cert=False, max_attempts=1) as uncertified:
        with pytest.raises(tinkerd.TinkerdError) as error:
            uncertified.list_models()
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
