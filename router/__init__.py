"""kvroute's proxy: the request path (``router.app``) and its background loops."""
