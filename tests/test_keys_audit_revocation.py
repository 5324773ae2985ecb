"""A key revoked with `polyroute keys revoke` (the file store) is refused by the running gateway even
when the file's timestamp cannot tell the revocation from the write before it.

The gateway re-read keys.json only when its mtime changed. Timestamps can be coarse (1 s on ext4
with small inodes and on some network mounts; a clock tick on kernels before 6.13), so a key created
and revoked within one tick, with a request in between, left the gateway on the creation's version:
the revoked key kept working until some later write. The test gives the revocation the creation's
mtime (os.utime), as such a filesystem does.
"""

from __future__ import annotations

import os

import httpx

from gateway.keys import FileKeyStore
from policies import parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway


def test_a_revocation_in_the_same_timestamp_tick_as_the_creation_is_seen(upstream, tmp_path):
    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path)  # key reload interval 0
    try:
        path = gw.data_dir / "keys.json"
        cli = FileKeyStore(path, reload_interval_s=0)  # what `polyroute keys` opens
        record, key = cli.create("initech", "laptop")
        created = path.stat()
        headers = {"authorization": f"Bearer {key}"}
        with httpx.Client(timeout=60) as http:
            assert http.get(gw.v1 + "/models", headers=headers).status_code == 200  # this version read
            cli.revoke(record.id)
            assert path.stat().st_ino != created.st_ino  # a new file, as every write makes
            os.utime(path, ns=(created.st_atime_ns, created.st_mtime_ns))  # ... in the same tick
            refused = http.get(gw.v1 + "/models", headers=headers)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
    finally:
        gw.server.stop()
