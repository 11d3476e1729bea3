# MLflow tracking server for infra/docker-compose.yml: the official image plus the Postgres driver, installed once
# when the image is built instead of at every start. Keep the version at the MLflow the project's clients use.
ARG MLFLOW_VERSION=3.17.2
FROM ghcr.io/mlflow/mlflow:v${MLFLOW_VERSION}
RUN pip install --no-cache-dir "psycopg2-binary>=2.9,<3"
