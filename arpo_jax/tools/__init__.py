"""Tools the policy calls with ``<tag>content</tag>``: sandboxed Python, Bright Data search, offline search.

Public API: ``make_tool(name, **params)`` returns a ``Tool`` (``.tag``, ``.execute(content) -> str``);
``ToolExecutor`` runs a round of calls concurrently. See docs/tools.md.
"""

from arpo_jax.tools.base import Tool
from arpo_jax.tools.executor import ExecutorConfig, ToolExecutor, ToolResult, empty_text, error_text
from arpo_jax.tools.offline_search import CacheSearchTool, LocalSearchTool
from arpo_jax.tools.python_sandbox import PythonSandbox, PythonSandboxConfig, PythonTool, preprocess_code
from arpo_jax.tools.search import BrightDataSearchTool, SearchConfig, format_results
from arpo_jax.tools.search_cache import SearchCache


def _make_search(backend: str = "brightdata", **params) -> Tool:
    """``search`` with ``backend`` = ``brightdata`` (online), ``cache`` or ``local`` (offline)."""
    if backend not in SEARCH_BACKENDS:
        raise ValueError(f"unknown search backend {backend!r}; choose one of {sorted(SEARCH_BACKENDS)}")
    return SEARCH_BACKENDS[backend](**params)


SEARCH_BACKENDS = {"brightdata": BrightDataSearchTool, "cache": CacheSearchTool, "local": LocalSearchTool}
TOOLS = {"python": PythonTool, "search": _make_search, "brightdata_search": BrightDataSearchTool,
         "cache_search": CacheSearchTool, "local_search": LocalSearchTool}


def make_tool(name: str, **params) -> Tool:
    """Builds a tool from config by name (``python``, ``search`` [``backend=``], or a backend's own name)."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; choose one of {sorted(TOOLS)}")
    return TOOLS[name](**params)


def make_executor(tools: dict[str, dict], **executor_params) -> ToolExecutor:
    """An executor over tools built from a ``{name: params}`` mapping (e.g. a config's ``tools`` section)."""
    return ToolExecutor([make_tool(name, **params) for name, params in tools.items()],
                        ExecutorConfig(**executor_params))


__all__ = ["BrightDataSearchTool", "CacheSearchTool", "ExecutorConfig", "LocalSearchTool", "PythonSandbox",
           "PythonSandboxConfig", "PythonTool", "SearchCache", "SearchConfig", "TOOLS", "Tool", "ToolExecutor",
           "ToolResult", "empty_text", "error_text", "format_results", "make_executor", "make_tool", "preprocess_code"]
