"""The tool interface: a trigger tag and ``execute(content) -> str``.

The model writes ``<tag>content</tag>``; the rollout passes ``content`` to the tool registered under ``tag`` and
wraps the returned text in ``<result>`` (spec 3.3). Tools must not raise for bad input or remote failures: they
return a text that tells the model what went wrong. The executor still guards against tools that do raise.
"""

import abc


class Tool(abc.ABC):
    """A tool callable from the rollout. Implementations must be thread-safe."""

    tag: str = ""  # trigger tag: the model calls the tool with <tag>...</tag>

    @abc.abstractmethod
    def execute(self, content: str) -> str:
        """Runs one call and returns the text shown to the model."""

    def close(self) -> None:  # noqa: B027 - optional hook, most tools hold nothing
        """Releases processes, threads and files held by the tool."""
