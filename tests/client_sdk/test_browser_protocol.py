"""The browser client's protocol.js is generated from firstbyte.protocol: the committed file
is exactly what the generator writes, so a wire change is one edit plus a regeneration."""

from __future__ import annotations

from firstbyte.client_sdk.browser_protocol import TARGET, main, render
from firstbyte.protocol import error_codes, paths, ws


def test_committed_protocol_js_is_the_generated_one() -> None:
    assert TARGET.read_text() == render(), (
        "run: python -m firstbyte.client_sdk.browser_protocol --write")


def test_it_carries_the_wire_constants() -> None:
    text = render()
    for value in (paths.CHAT_COMPLETIONS, paths.EDGE_TOKENS, ws.SUBPROTOCOL,
                  error_codes.CLIENT_TOKEN_EXPIRED, '"EVENT": "event"', '"CLOSE_POLICY": 1008'):
        assert str(value) in text


def test_check_mode_says_when_stale(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--check"]) == 0
    stale = tmp_path / "protocol.js"
    stale.write_text("// old\n")
    monkeypatch.setattr("firstbyte.client_sdk.browser_protocol.TARGET", stale)
    assert main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
