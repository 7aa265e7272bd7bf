"""No character of a password moves it out of the part redacted: for passwords of
every printable character, in every URL form (``redis``, ``rediss``, ``unix``,
IPv6, a ``?password=`` parameter), nothing the cache prints shows any of it: the
configuration's warnings and ``describe()``, the store's warnings and errors,
the lookup and put reasons the umbrella's report records, and ``torchloom cache
stats``, which names the real cause when the URL is unusable."""

from __future__ import annotations

import io
import logging
import string
from contextlib import redirect_stdout

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loom_cache import CacheConfig, CacheKey, Entry, KeyComponent, StoreUnavailable, cache_main
from loom_cache._config import redact, redact_url, url_problem
from loom_cache._redis import RedisStore
from loom_cache._tiered import open_store

#: Two tokens no URL part or message holds by chance: the password is
#: FRONT + generated characters + BACK, so a cut anywhere inside it shows one.
FRONT, BACK = "Qx7Lp2Vz", "Rk9Wm4Ty"
#: Every form on port 1 of loopback (or a missing socket): a connection fails at once.
FORMS = (
    "redis://{user}:{pw}@127.0.0.1:1/0",
    "rediss://{user}:{pw}@127.0.0.1:1/1",
    "unix://{user}:{pw}@/nonexistent/loom-redis.sock?db=0",
    "redis://{user}:{pw}@[::1]:1/0",
    "redis://127.0.0.1:1/0?password={pw}",
    "redis://{user}@127.0.0.1:1/0?db=0&password={pw}",
)
KEY = "fleet-key-0123456789abcdef"


def _entry() -> Entry:
    return Entry(CacheKey("p", (KeyComponent("graph", "cd" * 32, "g"),)), b"payload")


def _everything_printed(url: str, tmp: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    out: list[str] = [redact_url(url), url_problem(url) or ""]
    with caplog.at_level(logging.DEBUG, logger="torchloom.cache"):
        for env in (
            {"TORCHLOOM_REMOTE_CACHE": url},  # no key: the tier is off, with a warning
            {"TORCHLOOM_REMOTE_CACHE": url, "TORCHLOOM_REMOTE_CACHE_TRUST": "unsigned"},
            {"TORCHLOOM_REMOTE_CACHE": url, "TORCHLOOM_CACHE_KEY": KEY},
        ):
            from loom_cache import _config

            _config._resolve.cache_clear()
            config = CacheConfig.from_env({**env, "TORCHLOOM_CACHE_DIR": tmp})
            config = CacheConfig(
                config.dir,
                keys=config.keys,
                remote_url=config.remote_url,
                remote_trust=config.remote_trust,
                remote_timeout_s=0.2,
                remote_retry_after_s=0.001,
            )
            out += [repr(config), config.describe()]
            store = open_store(config, create=False)
            out.append(str(store.remote_off))
            # what the umbrella's report records: lookup and put reasons
            out.append(store.lookup(_entry().digest).reason)
            out.append(store.put(_entry()).reason)
            stats = io.StringIO()
            with redirect_stdout(stats):
                cache_main(["stats"], config=config)
            out.append(stats.getvalue())
        try:
            RedisStore(url, config=config).lookup(_entry().digest)
        except (StoreUnavailable, ValueError) as exc:
            out.append(str(exc))
    out += [r.getMessage() for r in caplog.records]
    return out


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    middle=st.text(alphabet=string.printable, max_size=10),
    user=st.sampled_from(["", "u", "alice"]),
    form=st.sampled_from(FORMS),
)
@example(middle="#", user="u", form=FORMS[0])  # the redis://u:Hash#SecretPw2@...
@example(middle="?/@:", user="", form=FORMS[3])
@example(middle="&x=1#", user="u", form=FORMS[5])
def test_no_printable_character_moves_a_password_into_sight(
    middle: str,
    user: str,
    form: str,
    tmp_path_factory: pytest.TempPathFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = form.format(user=user, pw=FRONT + middle + BACK)
    tmp = str(tmp_path_factory.mktemp("cache"))
    for text in _everything_printed(url, tmp, caplog):
        assert FRONT not in text and BACK not in text, (url, text)


@pytest.mark.parametrize("char", list(string.printable))
def test_every_printable_character_in_a_password_is_redacted(char: str) -> None:
    for form in FORMS:
        url = form.format(user="u", pw=f"{FRONT}{char}{BACK}{char}")
        shown = redact_url(url)
        assert FRONT not in shown and BACK not in shown, (url, shown)
        assert FRONT not in redact(f"auth failed for {FRONT}{char}{BACK}{char}", url)


def test_stats_names_a_raw_hash_in_the_password_as_the_cause(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "redis://u:Hash#SecretPw2@127.0.0.1:6379/0"
    config = CacheConfig(tmp_path, keys=(KEY.encode(),), remote_url=url)  # type: ignore[arg-type]
    assert cache_main(["stats"], config=config) == 0
    out = capsys.readouterr().out
    assert "SecretPw2" not in out and "Hash" not in out
    (remote,) = [ln for ln in out.splitlines() if ln.startswith("remote")]
    assert "off: unusable URL" in remote and "percent-encode" in remote and "Trust" not in remote


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:pw@[::1]:6379/0", "redis://u:***@[::1]:6379/0"),
        ("unix://u:pw@/run/redis.sock?db=0", "unix://u:***@/run/redis.sock?db=0"),
        ("redis://:p@ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://h/0?db=1&password=x&y=2", "redis://h/0?db=1&password=***"),
        ("redis://u:a/b@h:1/0", "redis://***"),
    ],
)
def test_urls_keep_their_host_and_lose_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
