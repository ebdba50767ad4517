"""Responses tools as chat function tools, and each chat function name back to its tool: pure.

Both directions need it: the request translation sends ``translate_tools``' chat tools and
checks ``tool_choice``; the stream translation maps a called function back (``tool_names``).

``function`` tools pass on as chat function tools. Codex also sends tools a local model cannot
serve as such: hosted tools OpenAI runs itself (``web_search``, ``file_search``,
``code_interpreter``, ``image_generation``, ``mcp``, ``computer_use*``, ``tool_search``) and
``local_shell`` (a tool only OpenAI's own models were trained on). These are dropped, not
refused, as Codex's own chat-completions client drops them: refusing would make Codex unusable
against the hub (``web_search`` is on by default in recent Codex), and the model simply never
sees the tool. A tool ``type`` nobody knows (a typo) is refused, naming it. ``custom``
(freeform) tools, e.g. Codex's ``apply_patch``, become a function with one string parameter
``input`` (as Codex's chat client does), and a call to one comes back as a ``custom_tool_call``
item with that ``input``; ``namespace`` tools (Codex's MCP tools) are flattened into functions
named ``<namespace><name>`` (``__`` between them unless the namespace ends with it) and come
back as ``function_call`` items with ``namespace`` set. Both round trips need the request: pass
it to ``ResponsesStream``/``fold`` (``request=``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gateway.apis.responses.errors import ResponsesError, invalid, unsupported

__all__ = [
    "DROPPED_TOOL_TYPES",
    "ToolName",
    "qualified_name",
    "tool_choice",
    "tool_name",
    "tool_names",
    "translate_tools",
]

# tool types a local chat model cannot be given: hosted by OpenAI, or native to its own models
DROPPED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "computer_use",
        "computer_use_preview",
        "computer",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)

_CUSTOM_INPUT_DESCRIPTION = "The whole input of the tool, as free text"


class ToolName(NamedTuple):
    """How a chat function name maps back to a Responses tool."""

    kind: str  # "function" or "custom"
    name: str
    namespace: str | None


def qualified_name(namespace: str, name: str) -> str:
    """The chat function name of ``name`` in ``namespace``."""
    return namespace + name if namespace.endswith("__") else f"{namespace}__{name}"


def _function_tool(tool: dict[str, Any], where: str, name: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid(f"{where}.description", "expected a string.")
        function["description"] = description
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.parameters", "expected a JSON schema object.")
        function["parameters"] = parameters
    strict = tool.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise invalid(f"{where}.strict", "expected a boolean.")
        function["strict"] = strict
    return {"type": "function", "function": function}


def tool_name(tool: dict[str, Any], where: str) -> str:
    """The non-empty ``name`` of a tool (or a call item) at ``where``; refused otherwise."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", "expected a non-empty string.")
    return name


def translate_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, ToolName]]:
    """(chat tools, chat function name → Responses tool) for a request's ``tools``."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise invalid("tools", "expected an array of tools.")
    chat: list[dict[str, Any]] = []
    names: dict[str, ToolName] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, "expected a tool object.")
        kind = tool.get("type")
        if kind == "function":
            name = tool_name(tool, where)
            chat.append(_function_tool(tool, where, name))
            names[name] = ToolName("function", name, None)
        elif kind == "custom":
            name = tool_name(tool, where)
            params = {
                "type": "object",
                "properties": {
                    "input": {"type": "string", "description": _CUSTOM_INPUT_DESCRIPTION}
                },
                "required": ["input"],
                "additionalProperties": False,
            }
            chat.append(_function_tool({**tool, "parameters": params, "strict": None}, where, name))
            names[name] = ToolName("custom", name, None)
        elif kind == "namespace":
            namespace = tool_name(tool, where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise invalid(f"{where}.tools", "expected an array of function tools.")
            for j, member in enumerate(members):
                inner = f"{where}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type", "function") != "function":
                    raise invalid(inner, "a namespace holds function tools only.")
                name = tool_name(member, inner)
                qualified = qualified_name(namespace, name)
                chat.append(_function_tool(member, inner, qualified))
                names[qualified] = ToolName("function", name, namespace)
        elif kind in DROPPED_TOOL_TYPES:
            continue
        else:
            raise unsupported(
                f"{where}.type",
                f"Tool type {kind!r} is not supported: the hub serves function and custom tools "
                "(hosted tools such as web_search are left out).",
            )
    return chat, names


def tool_choice(choice: Any, names: dict[str, ToolName]) -> Any:
    """The chat ``tool_choice`` of a Responses one; a named tool must be among ``names``."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom"):
            name = choice.get("name")
            if not isinstance(name, str):
                raise invalid("tool_choice.name", "expected a string.")
            namespace = choice.get("namespace")
            if isinstance(namespace, str):
                name = qualified_name(namespace, name)
            if name not in names:
                raise invalid("tool_choice.name", f"no function tool named {name!r} in tools.")
            return {"type": "function", "function": {"name": name}}
        raise unsupported(
            "tool_choice",
            f"tool_choice of type {kind!r} is not supported: use auto, none, required or "
            '{"type": "function", "name": ...}.',
        )
    raise invalid("tool_choice", 'expected "auto", "none", "required" or a function choice.')


def tool_names(request: dict[str, Any] | None) -> dict[str, ToolName]:
    """Chat function name → Responses tool, for a (valid) request; {} when it has none."""
    if not request:
        return {}
    try:
        return translate_tools(request.get("tools"))[1]
    except (ResponsesError, RecursionError):
        return {}
