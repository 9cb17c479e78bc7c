"""The job store the store test modules run against: one secret, a store hosted on loopback."""

import pytest

from hspmd.backends.store import new_secret, open_store

SECRET = new_secret().encode()


@pytest.fixture
def store():
    """The job's store on 127.0.0.1 (a free port), hosted and joined with SECRET; closed after."""
    s = open_store("127.0.0.1", 0, is_master=True, secret=SECRET, timeout=10)
    yield s
    s.server.close()
