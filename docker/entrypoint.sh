#!/bin/sh
# Applies the database migrations, then runs tito-proxy (by default `serve`, configured by TITO_*).
set -eu
tito-proxy migrate
exec tito-proxy "$@"
