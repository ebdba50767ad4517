"""What crosses a socket, shared by the runner, the hub and the simulator: the socket layer
(``netio``), the HTTP/1.1 and WebSocket server core (``server``, ``http``), the WebSocket frame
codec of both ends (``wsframes``), the HTTP/1.1 client (``http1``), the WebSocket client
(``wsclient``), the Chat Channel's frames
(``protocol``) and the SSE splitter (``sse``)."""
