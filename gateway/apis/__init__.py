"""The three client APIs (OpenAI chat completions, Anthropic Messages, OpenAI Responses): each
one's requests and answers as chat completions, the one shape the hub's runners speak; pure:
msgspec and bytes, no trio, nothing of the hub.

``chunks``: the chat chunk's schema, written once; ``shapes``: chat-completions requests,
answers and errors; ``dialects``: one API's request → a chat turn and its chunks → that API's
answer; ``messages/`` and ``responses/``: Anthropic's Messages API and OpenAI's Responses API;
``continuation``: a cut answer continued as one (the runner's and the hub's). The hub's routes
(``gateway.hub.frontdoor``) and its turns use them, the runner its continuation.
"""
