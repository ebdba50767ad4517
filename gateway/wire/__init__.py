"""What crosses a socket, shared by the runner, the hub and the simulator: the socket layer
(``netio``), the HTTP/1.1 and WebSocket server core (the listener ``server``, its connections
``httpconn`` and ``wsserver``, and ``http``, ``errors``), the HTTP/1.1 client (``http1``,
``proxy``) and a backend's answer read sans-IO (``stream``, ``sse``), the WebSocket client
(``wsclient``), the connection state (``wsconn``) and frames (``wsframes``) for both ends, the
Chat Channel's frames (``protocol``) and the W3C trace context they carry (``traceparent``)."""
