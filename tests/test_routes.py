"""Routes: the built-in catalog, config tables over it, and capacity that is never guessed."""

from __future__ import annotations

from typing import Any

import pytest

from compactd.core.pricing import ImagePricing
from compactd.errors import ConfigError
from compactd.routes import BUILTIN_ROUTES, Route, RouteCatalog
from compactd.tokenizers import KNOWN_TOKENIZERS


def config_error(tables: list[dict[str, Any]]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        RouteCatalog.from_config(tables)
    return caught.value


def test_the_builtin_catalog_declares_published_windows() -> None:
    catalog = RouteCatalog()
    chat = catalog.get("deepseek", "deepseek-chat")
    assert chat is not None
    assert (chat.context_window, chat.default_output_tokens, chat.tokenizer) == (
        128_000,
        4_096,
        "deepseek-v4",
    )
    flash = catalog.get("deepseek", "deepseek-v4-flash")
    assert flash is not None
    assert flash.context_window == 1_048_576
    gpt4o = catalog.get("openai", "gpt-4o")
    assert gpt4o is not None
    assert (gpt4o.context_window, gpt4o.default_output_tokens) == (128_000, 16_384)
    assert gpt4o.image_pricing == ImagePricing(per_image=85, per_tile=170)


def test_every_builtin_route_has_capacity_and_a_known_tokenizer() -> None:
    for route in BUILTIN_ROUTES:
        assert route.context_window is not None
        assert route.context_window > 0
        assert route.tokenizer in KNOWN_TOKENIZERS
        if route.provider == "vllm":  # self-hosted: the operator's [[routes]] gives the URL
            assert route.tokenizer_file
            assert not route.base_url
        else:
            assert route.base_url.startswith("https://")


def test_an_undeclared_route_has_no_capacity() -> None:
    route = RouteCatalog().resolve("local", "mystery-model")
    assert route == Route("local", "mystery-model")
    assert route.context_window is None
    assert route.tokenizer == "heuristic"
    assert RouteCatalog().get("local", "mystery-model") is None


def test_config_routes_declare_new_models() -> None:
    catalog = RouteCatalog.from_config(
        [
            {
                "provider": "local",
                "model": "small-context",
                "context_window": 16384,
                "max_output_tokens": 2048,
                "tokenizer": "cl100k_base",
                "message_overhead": 5,
                "tool_overhead": 8,
                "image_tokens": 258,
                "sends_reasoning": False,
                "protocol": "openai",
                "base_url": "http://127.0.0.1:8080/v1",
                "api_key_env": "LOCAL_KEY",
            }
        ]
    )
    route = catalog.get("local", "small-context")
    assert route == Route(
        "local",
        "small-context",
        16384,
        2048,
        tokenizer="cl100k_base",
        message_overhead=5,
        tool_overhead=8,
        image_pricing=ImagePricing(per_image=258),
        sends_reasoning=False,
        base_url="http://127.0.0.1:8080/v1",
        api_key_env="LOCAL_KEY",
    )
    assert route.name == "local/small-context"
    assert route.pricing.framing.per_message == 5
    assert catalog.get("deepseek", "deepseek-chat") is not None  # built-ins stay


def test_a_config_table_overrides_only_the_keys_it_sets() -> None:
    catalog = RouteCatalog.from_config(
        [{"provider": "deepseek", "model": "deepseek-chat", "base_url": "http://127.0.0.1:9"}]
    )
    route = catalog.get("deepseek", "deepseek-chat")
    assert route is not None
    assert (route.base_url, route.context_window) == ("http://127.0.0.1:9", 128_000)


def test_size_based_image_pricing_is_configurable() -> None:
    catalog = RouteCatalog.from_config(
        [
            {
                "provider": "p",
                "model": "m",
                "image_pricing": {"per_image": 85, "per_tile": 170, "tile_side": 512},
            }
        ],
        builtin=False,
    )
    route = catalog.get("p", "m")
    assert route is not None
    assert route.image_pricing == ImagePricing(per_image=85, per_tile=170)
    assert len(catalog) == 1


def test_the_pricing_profile_follows_the_tokenizer() -> None:
    deepseek = RouteCatalog().resolve("deepseek", "deepseek-chat")
    assert deepseek.pricing.tokenizer.name == "deepseek-v4"
    assert deepseek.pricing.exact
    assert not deepseek.pricing.sends_reasoning
    assert not Route("p", "m").pricing.exact


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"model": "m"}, "routes[0].provider"),
        ({"provider": "p", "model": ""}, "routes[0].model"),
        ({"provider": "p", "model": "m", "context_window": 0}, "routes[0].context_window"),
        ({"provider": "p", "model": "m", "context_window": "128k"}, "routes[0].context_window"),
        ({"provider": "p", "model": "m", "context_window": True}, "routes[0].context_window"),
        ({"provider": "p", "model": "m", "max_output_tokens": -1}, "routes[0].max_output_tokens"),
        ({"provider": "p", "model": "m", "tokenizer": "gpt2"}, "routes[0].tokenizer"),
        ({"provider": "p", "model": "m", "sends_reasoning": "no"}, "routes[0].sends_reasoning"),
        ({"provider": "p", "model": "m", "base_url": 5}, "routes[0].base_url"),
        ({"provider": "p", "model": "m", "window": 5}, "routes[0].window"),
        (
            {"provider": "p", "model": "m", "image_pricing": {"per_tile": 1}},
            "routes[0].image_pricing.per_image",
        ),
        (
            {"provider": "p", "model": "m", "image_pricing": {"per_image": 1, "dpi": 2}},
            "routes[0].image_pricing.dpi",
        ),
        (
            {"provider": "p", "model": "m", "image_pricing": {"per_image": 1, "tile_side": 0}},
            "routes[0].image_pricing.tile_side",
        ),
    ],
)
def test_malformed_route_tables_name_the_field(table: dict[str, Any], field: str) -> None:
    assert config_error([table]).metadata["field"] == field


def test_both_image_forms_are_rejected() -> None:
    table = {"provider": "p", "model": "m", "image_tokens": 5, "image_pricing": {"per_image": 5}}
    assert config_error([table]).metadata["field"] == "routes[0].image_pricing"


def test_duplicate_route_tables_are_rejected() -> None:
    table = {"provider": "p", "model": "m", "context_window": 1000}
    error = config_error([table, {"provider": "p", "model": "n"}, table])
    assert error.metadata["field"] == "routes[2]"
    assert "duplicate" in error.message
