"""POST /admin/keys: a limit of JSON `true` is refused (pydantic's lax mode read it as 1 a minute),
and a key for a tenant the policy in force does not name is created with a warning that says what
it lacks, as `polyroute keys create` says on stderr."""

from __future__ import annotations

import httpx
import pytest


def _create(gateway, body: dict) -> httpx.Response:
    return httpx.post(gateway.url + "/admin/keys", headers=gateway.auth(gateway.admin_key), json=body)


@pytest.mark.parametrize("field", ["rpm", "tpm"])
def test_a_boolean_limit_is_refused_and_no_key_is_made(gateway, field):
    before = httpx.get(gateway.url + "/admin/keys", headers=gateway.auth(gateway.admin_key)).json()
    refused = _create(gateway, {"tenant": "booltest", field: True})
    assert refused.status_code == 400, refused.text
    assert "not true/false" in refused.text and field in refused.text
    after = httpx.get(gateway.url + "/admin/keys", headers=gateway.auth(gateway.admin_key)).json()
    assert after == before  # nothing written


def test_a_key_for_a_tenant_the_policy_does_not_name_says_so(gateway):
    made = _create(gateway, {"tenant": "acem", "rpm": 5})
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["key"] and body["rpm"] == 5
    assert "'acem' is not in the policy in force" in body["warning"]
    named = _create(gateway, {"tenant": "default"})  # the default policy names this one
    assert named.status_code == 201 and "warning" not in named.json()
