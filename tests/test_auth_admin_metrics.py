"""Auth (401s in the OpenAI format), admin key routes, health/readiness, and /metrics counting."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from polyroute import Client, PolyrouteError

MESSAGES = [{"role": "user", "content": "hello"}]
BODY = {"model": "auto", "messages": MESSAGES}


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"authorization": "Bearer pr-not-a-real-key"}, "invalid_api_key"),
        ({"authorization": "Basic dXNlcjpwYXNz"}, "invalid_api_key"),
        ({"authorization": "Bearer"}, "invalid_api_key"),
    ],
)
def test_missing_or_wrong_key_is_401(gateway, upstream, headers, code):
    response = httpx.post(gateway.v1 + "/chat/completions", json=BODY, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == code
    assert response.headers["www-authenticate"] == "Bearer"
    assert not upstream.requests


def test_openai_sdk_sees_authentication_error(gateway):
    client = openai.OpenAI(base_url=gateway.v1, api_key="pr-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="auto", messages=MESSAGES)


def test_admin_key_is_not_a_client_key(gateway):
    response = httpx.post(
        gateway.v1 + "/chat/completions", json=BODY, headers=gateway.auth(gateway.admin_key)
    )
    assert response.status_code == 401


def test_models_needs_a_key(gateway):
    assert httpx.get(gateway.v1 + "/models").status_code == 401


def test_admin_routes_need_the_admin_key(gateway):
    assert httpx.get(gateway.url + "/admin/keys").status_code == 401
    response = httpx.get(gateway.url + "/admin/keys", headers=gateway.auth())
    assert response.status_code == 403 and response.json()["error"]["code"] == "not_admin"


def test_admin_creates_and_revokes_a_key_through_the_sdk(gateway, upstream):
    with Client(gateway.url, admin_key=gateway.admin_key) as admin:
        created = admin.create_key("globex", name="ci")
        assert created["tenant"] == "globex" and created["key"].startswith("pr-")
        listed = httpx.get(gateway.url + "/admin/keys", headers=gateway.auth(gateway.admin_key)).json()[
            "data"
        ]
        assert created["id"] in {k["id"] for k in listed}
        assert all("key_hash" not in k and "key" not in k for k in listed)
        with Client(gateway.url, api_key=created["key"]) as user:
            assert user.chat(MESSAGES).route.worker == "cheap"
            admin.revoke_key(created["id"])
            with pytest.raises(PolyrouteError) as info:
                user.chat(MESSAGES)
        assert info.value.status == 401


def test_keys_are_stored_hashed(gateway):
    stored = (gateway.data_dir / "keys.json").read_text()
    assert gateway.api_key not in stored
    assert (gateway.data_dir / "keys.json").stat().st_mode & 0o777 == 0o600


def test_revoking_unknown_key_is_404(gateway):
    response = httpx.delete(gateway.url + "/admin/keys/key_nope", headers=gateway.auth(gateway.admin_key))
    assert response.status_code == 404 and response.json()["error"]["code"] == "key_not_found"


def test_admin_create_key_validates_body(gateway):
    response = httpx.post(
        gateway.url + "/admin/keys", json={"tenant": "bad tenant!"}, headers=gateway.auth(gateway.admin_key)
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tenant"


def test_healthz_and_readyz(gateway):
    assert httpx.get(gateway.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway.url + "/readyz")
    assert ready.status_code == 200
    workers = ready.json()["workers"]
    assert workers["cheap"] == {"ready": True}
    assert workers["nokey"]["ready"] is False and "POLYROUTE_TEST_UNSET_KEY" in workers["nokey"]["reason"]


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_a_request(gateway, upstream):
    upstream.behave("cheap-model", prompt_tokens=300, completion_tokens=100)
    before = httpx.get(gateway.url + "/metrics").text
    response = httpx.post(gateway.v1 + "/chat/completions", json=BODY, headers=gateway.auth())
    assert response.status_code == 200
    httpx.post(gateway.v1 + "/chat/completions", content=b"{oops", headers=gateway.auth())
    after = httpx.get(gateway.url + "/metrics").text

    def delta(name: str, **labels: str) -> float:
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    assert delta("polyroute_requests_total", worker="cheap", strategy="fast", status="200") == 1
    assert delta("polyroute_tokens_total", worker="cheap", kind="prompt") == 300
    assert delta("polyroute_tokens_total", worker="cheap", kind="completion") == 100
    assert delta("polyroute_cost_usd_total", worker="cheap") == pytest.approx(300 * 0.1e-6 + 100 * 0.2e-6)
    assert delta("polyroute_request_latency_seconds_count", stream="false") == 2  # the 400 is timed too
    assert delta("polyroute_errors_total", type="invalid_json") == 1


def test_key_created_by_another_process_works_without_restart(gateway):
    """The CLI writes the shared key file; the running gateway picks it up (reload interval 0 here)."""
    from gateway.keys import FileKeyStore

    other_process_view = FileKeyStore(gateway.data_dir / "keys.json")
    record, key = other_process_view.create("initech")
    headers = {"authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 5
    while httpx.get(gateway.v1 + "/models", headers=headers).status_code != 200:
        assert time.monotonic() < deadline, "new key never accepted"
        time.sleep(0.05)
    other_process_view.revoke(record.id)
    deadline = time.monotonic() + 5
    while httpx.get(gateway.v1 + "/models", headers=headers).status_code != 401:
        assert time.monotonic() < deadline, "revoked key still accepted"
        time.sleep(0.05)
