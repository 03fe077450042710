"""The exporter's HTTP side: the asyncio server (server.py), the WSGI app and its routes
(app.py), TLS and basic auth (webconfig.py), and the live page (livepage.py, static/).
"""
