"""What crosses a socket, shared by the runner, the hub and the simulator: the HTTP/1.1 and
WebSocket server core (``server``), its request and response (``http``), WebSocket frames as a
server reads them (``wsframes``)."""
