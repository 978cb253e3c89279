"""The explorer's HTTP API: every bad request gets one clear sentence and a 4xx, never a 500."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from gradflow.explore.server import MAX_BODY_BYTES, create_app  # noqa: E402
from gradflow.explore.service import ExploreConfig, ExploreService  # noqa: E402
from gradflow.models import load_model  # noqa: E402

TEXT = "The abundant fruits of another year have blessed our country."
MODEL = "gradflow-mini-en"


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(ExploreService(ExploreConfig(models=(MODEL,), max_tokens=40)))) as c:
        yield c


def _error(response, status: int, *phrases: str) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert "Traceback" not in message and "\n" not in message
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_page_and_plotly_are_served_locally(client):
    page = client.get("/")
    assert page.status_code == 200 and 'src="static/plotly.min.js"' in page.text and MODEL in page.text
    js = client.get("/static/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000
    assert client.get("/api/models").json()["models"] == [MODEL]


@pytest.mark.parametrize("body, phrase", [(b"{not json", "not valid JSON"), (b"\xff\xfe", "not valid JSON"),
                                          (b"[1, 2]", "JSON object"), (b"", "JSON object"),
                                          (b'"text"', "JSON object")])
def test_bad_json_is_a_400(client, body, phrase):
    _error(client.post("/api/view", content=body), 400, phrase)


@pytest.mark.parametrize("request_body, status, phrase", [
    ({"model": "bert-base-uncased", "text": TEXT}, 404, "unknown model"),
    ({"model": "/etc/passwd", "text": TEXT}, 404, "restart it with --model"),
    ({"model": ["x"], "text": TEXT}, 404, "unknown model"),
    ({"model": MODEL, "text": ""}, 400, "text is empty"),
    ({"model": MODEL, "text": "   "}, 400, "text is empty"),
    ({"model": MODEL, "text": 5}, 400, "text is empty"),
    ({"model": MODEL, "text": "word " * 60}, 413, "at most 40"),
    ({"model": MODEL, "text": "x" * 700}, 413, "at most 600"),
    ({"model": MODEL, "text": TEXT, "mask": [0]}, 400, "special token"),
    ({"model": MODEL, "text": TEXT, "mask": [99]}, 400, "out of range"),
    ({"model": MODEL, "text": TEXT, "mask": ["1"]}, 400, "whole numbers"),
    ({"model": MODEL, "text": TEXT, "mask": [True]}, 400, "whole numbers"),
    ({"model": MODEL, "text": TEXT, "mask": "all"}, 400, "'random'"),
    ({"model": MODEL, "text": TEXT, "mask": [2], "loss": "ce"}, 400, "unknown loss"),
    ({"model": MODEL, "text": TEXT, "mask": "random", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "text": TEXT, "mask": "random", "seed": 1.5}, 400, "seed"),
])
def test_bad_requests_get_a_sentence(client, request_body, status, phrase):
    _error(client.post("/api/view", json=request_body), status, phrase)


def test_over_long_body_is_refused(client):
    _error(client.post("/api/view", content=b"{" + b" " * MAX_BODY_BYTES + b"}"), 413, "bytes")


def test_masking_none_gives_the_tokens_and_a_notice(client):
    data = client.post("/api/view", json={"model": MODEL, "text": TEXT, "mask": []}).json()
    assert data["grad_norm"] is None and "No token is selected" in data["notice"]
    assert data["tokens"][0] == "[CLS]" and set(data["roles"][1:-1]) == {"context"}


def test_masking_every_token_leaves_nothing_dark(client):
    tokens = client.post("/api/view", json={"model": MODEL, "text": TEXT, "mask": []}).json()["tokens"]
    words = list(range(1, len(tokens) - 1))
    data = client.post("/api/view", json={"model": MODEL, "text": TEXT, "mask": words}).json()
    assert set(data["roles"][1:-1]) == {"masked"}
    assert data["last_block_zero"] == [True] + [False] * len(words) + [True]


def test_one_masked_token_darkens_every_other_channel_in_the_last_block(client):
    data = client.post("/api/view", json={"model": MODEL, "text": TEXT, "mask": [4], "loss": "mlm"}).json()
    start = data["last_block_start"]
    for t, row in enumerate(data["grad_norm"]):
        assert (row[start] > 0 and row[-1] > 0) if t == 4 else (row[start] == 0 and row[-1] == 0)


def test_exports_are_files(client):
    query = {"model": MODEL, "text": TEXT, "mask": "4", "loss": "mlm"}
    png = client.get("/api/export", params={**query, "format": "png"})
    assert png.status_code == 200 and png.content[:4] == b"\x89PNG"
    pdf = client.get("/api/export", params={**query, "format": "pdf"})
    assert pdf.status_code == 200 and pdf.content[:4] == b"%PDF"
    csv = client.get("/api/export", params={**query, "format": "csv"})
    assert csv.status_code == 200 and csv.text.startswith("position,token,input_token,role,site")
    assert "attachment" in csv.headers["content-disposition"]
    _error(client.get("/api/export", params={**query, "format": "svg"}), 400, "unknown export format")
    _error(client.get("/api/export", params={**query, "mask": ""}), 400, "nothing to export")
    _error(client.get("/api/export", params={**query, "mask": "a,b"}), 400, "whole number")
    _error(client.get("/api/export", params={**query, "seed": "x"}), 400, "seed")


def test_unknown_routes_and_methods(client):
    _error(client.get("/etc/passwd"), 404, "not part of the explorer")
    _error(client.get("/api/view"), 405, "POST")


def test_the_server_survives_a_failure_inside_a_request():
    calls = []

    def loader(name):
        calls.append(name)
        if len(calls) == 1:
            raise RuntimeError("disk on fire")
        return load_model(name)

    with TestClient(create_app(ExploreService(ExploreConfig(models=(MODEL,)), loader=loader)),
                    raise_server_exceptions=False) as client:
        message = _error(client.post("/api/view", json={"model": MODEL, "text": TEXT, "mask": [2]}), 500, "still running")
        assert "disk on fire" in message
        assert client.post("/api/view", json={"model": MODEL, "text": TEXT, "mask": [2]}).status_code == 200


def test_a_full_queue_answers_busy():
    service = ExploreService(ExploreConfig(models=(MODEL,), max_waiting=0))
    release, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(10)

    worker = threading.Thread(target=service._run, args=(hold,))
    worker.start()
    started.wait(10)
    try:
        with TestClient(create_app(service)) as client:
            _error(client.post("/api/view", json={"model": MODEL, "text": TEXT, "mask": [2]}), 503, "busy")
    finally:
        release.set()
        worker.join(10)
    assert service._waiting == 0


def test_cli_explore_binds_to_localhost_and_names_its_models(monkeypatch):
    from gradflow.cli import main
    from gradflow.explore import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda service, host, port: seen.update(host=host, port=port,
                                                                                   models=service.models()))
    from gradflow.models import EMBEDDED_MODELS, installed_embedded_models

    assert main(["explore"]) == 0
    # every installed embedded model, in the family's order (a checkout set up by ./setup.sh has them all)
    assert installed_embedded_models() == list(EMBEDDED_MODELS)
    assert seen == {"host": "127.0.0.1", "port": 8765, "models": list(EMBEDDED_MODELS)}
    assert main(["explore", "--model", MODEL, MODEL, "--port", "9000", "--host", "0.0.0.0"]) == 0
    assert seen == {"host": "0.0.0.0", "port": 9000, "models": [MODEL]}
    assert main(["explore", "--port", "70000"]) == 2


def test_cli_channels_writes_the_static_page(tmp_path, capsys):
    from gradflow.cli import main

    page = tmp_path / "view.html"
    args = ["channels", "--model", MODEL, "--text", TEXT, "--mask-positions", "3", "--out", str(tmp_path / "figs"),
            "--format", "png", "--html", str(page)]
    assert main(args) == 0
    assert page.stat().st_size > 1_000_000 and '"mode": "static"' in page.read_text(encoding="utf-8")
    assert main([*args, "--quantity", "attribution"]) == 2
    assert "--html shows the gradient norms only" in capsys.readouterr().err


def test_each_model_starts_from_a_sentence_in_its_own_vocabulary():
    from gradflow.explore.service import DEFAULT_TEXT
    from gradflow.models.zoo import example_inputs

    service = ExploreService(ExploreConfig(models=(MODEL, "zoo:antiberty", "zoo:rxnfp"), max_tokens=40))
    examples = service.examples()
    assert examples[MODEL] == DEFAULT_TEXT
    assert examples["zoo:antiberty"] == example_inputs("antiberty")[0][:38]
    assert examples["zoo:rxnfp"] == example_inputs("rxnfp")[0][:38]
    with TestClient(create_app(service)) as client:
        page = client.get("/").text
    assert '"examples"' in page and examples["zoo:antiberty"] in page


def test_cli_explore_stops_before_serving_when_a_model_cannot_load(monkeypatch, tmp_path, capsys):
    from gradflow.cli import main
    from gradflow.explore import server

    served = []
    monkeypatch.setattr(server, "serve", lambda service, host, port: served.append(port))
    assert main(["explore", "--model", MODEL, str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert served == [] and "could not be loaded" in err and "no-such-model" in err and "Traceback" not in err
    assert f"loading {MODEL}" in err


def test_a_port_in_use_is_a_clear_error():
    import socket

    from gradflow.errors import ExploreError
    from gradflow.explore.server import listening_socket, serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ExploreError, match=f"cannot listen on 127.0.0.1:{port} .*another --port"):
            serve(ExploreService(ExploreConfig(models=(MODEL,))), port=port)
    with pytest.raises(ExploreError, match="check --host"):
        listening_socket("no-such-host.invalid", 8765)
    free = listening_socket("127.0.0.1", 0)
    assert free.getsockname()[0] == "127.0.0.1"
    free.close()
