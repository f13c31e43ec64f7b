import pytest


@pytest.fixture(autouse=True)
def _clean_hal_env(monkeypatch):
    """Tests start from the default HAL selection regardless of the caller's environment."""
    for var in ("DSV4CORE_BACKEND", "DSV4CORE_OPS", "DSV4CORE_FALLBACK", "DSV4CORE_CHECK", "DSV4CORE_VERIFY",
                "DSV4CORE_VERIFY_STRICT", "DSV4CORE_VERIFY_SEED", "DSV4CORE_PLUGINS", "DSV4CORE_PROBE_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    yield
