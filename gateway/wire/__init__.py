"""What crosses a socket, shared by the runner, the hub and the simulator: the socket layer
(``netio``), the HTTP/1.1 and WebSocket server core (``server``, ``http``, ``errors``), the
HTTP/1.1 client (``http1``, ``proxy``) and a backend's answer read sans-IO (``stream``, ``sse``),
the WebSocket client (``wsclient``) and frames for both ends (``wsframes``), the Chat Channel's
frames (``protocol``) and the W3C trace context they carry (``traceparent``)."""
