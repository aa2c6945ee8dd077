"""The ids Sluice answers with: minted in one place, each prefix spelled there alone."""

from __future__ import annotations

from pathlib import Path

from server.core.ids import PREFIXES, new_id, own_part, public_id

SERVER = Path(__file__).resolve().parents[2] / "server"


def test_an_id_is_its_prefix_and_its_own_part() -> None:
    for kind, prefix in PREFIXES.items():
        minted = new_id(kind)
        assert minted.startswith(prefix)
        assert public_id(kind, own_part(minted)) == minted
    assert public_id("chat", "abc") == "chatcmpl-abc"
    assert own_part("cmpl-abc") == "abc"
    assert new_id("file") != new_id("file")


def test_each_prefix_is_spelled_in_the_server_once() -> None:
    sources = {path: path.read_text() for path in SERVER.rglob("*.py")}
    for prefix in (
        "chatcmpl-",
        '"cmpl-',
        '"resp_"',
        '"msg_"',
        '"batch_"',
        '"batch_req_"',
        '"file-"',
        '"conv_"',
    ):
        spelled = [path.relative_to(SERVER) for path, text in sources.items() if prefix in text]
        assert [str(path) for path in spelled] == ["core/ids.py"], prefix
