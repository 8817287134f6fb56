import pytest

from lmcache_mp.quota_spec import Quota, QuotaError, parse_quota, parse_quota_flag
from lmcache_mp.server.cache.quotas import QuotaBook, load_quota_file

MiB = 1024**2


def test_parse_quota():
    assert parse_quota("2GiB") == Quota(2 * 1024 * MiB, 0)
    assert parse_quota("2GiB:512MiB") == Quota(2 * 1024 * MiB, 512 * MiB)
    assert parse_quota("unlimited:1MiB") == Quota(None, MiB)
    assert parse_quota_flag("team-a=1MiB") == ("team-a", Quota(MiB))
    assert parse_quota_flag("=1MiB") == ("", Quota(MiB))


@pytest.mark.parametrize("text,words", [
    ("-1GiB", "invalid size"), ("lots", "invalid size"), ("1MiB:2MiB", "exceeds cap"),
    ("1MiB:x", "reservation"),
])
def test_bad_quotas_are_refused(text, words):
    with pytest.raises(QuotaError, match=words):
        parse_quota(text)


def test_flag_needs_a_salt_and_a_quota():
    with pytest.raises(QuotaError, match="SALT=CAP"):
        parse_quota_flag("1GiB")


def test_layers_runtime_over_file_over_flags():
    book = QuotaBook(100 * MiB, Quota(cap=MiB), {"a": Quota(2 * MiB), "b": Quota(3 * MiB)},
                     {"b": Quota(4 * MiB)})
    assert book.get("a").cap == 2 * MiB and book.get("b").cap == 4 * MiB
    assert book.get("nobody") == Quota(cap=MiB)
    book.set("b", Quota(5 * MiB))
    assert book.get("b").cap == 5 * MiB
    book.replace_file({})
    assert book.get("b").cap == 5 * MiB  # the run-time setting still wins
    assert book.delete("b") and book.get("b").cap == 3 * MiB  # back to the flag
    assert not book.delete("b")
    assert set(book.configured()) == {"a", "b"}


def test_reservations_may_not_exceed_the_pool():
    with pytest.raises(QuotaError, match="more than the"):
        QuotaBook(10 * MiB, Quota(), {"a": Quota(reserve=6 * MiB), "b": Quota(reserve=5 * MiB)})
    book = QuotaBook(10 * MiB, Quota(), {"a": Quota(reserve=6 * MiB)})
    with pytest.raises(QuotaError, match="reservations add up to"):
        book.set("b", Quota(reserve=5 * MiB))
    with pytest.raises(QuotaError):
        book.replace_file({"c": Quota(reserve=5 * MiB)})
    assert "b" not in book.configured() and "c" not in book.configured()


def test_quota_file(tmp_path):
    path = tmp_path / "quotas.toml"
    path.write_text('[quotas]\n"team-a" = "2MiB:1MiB"\n"team-b" = { cap = "unlimited", '
                    'reserve = "1MiB" }\n"" = "3MiB"\n')
    assert load_quota_file(path) == {"team-a": Quota(2 * MiB, MiB), "team-b": Quota(None, MiB),
                                     "": Quota(3 * MiB)}


@pytest.mark.parametrize("text,words", [
    ("[quotas\n", "quota file"),
    ('[quotas]\n"a" = 5\n', "expected"),
    ('[quotas]\n"a" = "1MiB:2MiB"\n', "exceeds cap"),
    ('[quotas]\n"has space" = "1MiB"\n', "cache_salt"),
    ('quotas = 3\n', "must be a table"),
])
def test_bad_quota_files_are_refused(tmp_path, text, words):
    path = tmp_path / "quotas.toml"
    path.write_text(text)
    with pytest.raises(QuotaError, match=words):
        load_quota_file(path)


def test_missing_quota_file():
    with pytest.raises(QuotaError, match="No such file"):
        load_quota_file("/nonexistent/quotas.toml")


def test_delete_is_refused_when_the_quota_it_uncovers_breaks_the_pool():
    book = QuotaBook(64 * MiB, Quota(), {"a": Quota(reserve=60 * MiB)})
    book.set("a", Quota(reserve=0))
    book.set("b", Quota(reserve=60 * MiB))
    with pytest.raises(QuotaError, match="reservations add up to"):
        book.delete("a")
    assert book.get("a").reserve == 0
