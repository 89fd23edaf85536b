"""LitServe API, server CLI (`vision-serve`) and client (`vision-classify`)."""
