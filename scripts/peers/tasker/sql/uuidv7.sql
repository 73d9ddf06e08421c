-- uuidv7() for PostgreSQL 15, which lacks it (18 has it built in; Tasker's migrations alias it).
-- RFC 9562 layout: 48 bits of Unix milliseconds, version 7, then the random bits and the RFC
-- variant of a gen_random_uuid() (core since PostgreSQL 13).
CREATE OR REPLACE FUNCTION public.uuidv7() RETURNS uuid
LANGUAGE plpgsql VOLATILE PARALLEL SAFE AS $$
DECLARE
  millis bigint := floor(extract(epoch FROM clock_timestamp()) * 1000);
  bytes bytea := uuid_send(gen_random_uuid());
BEGIN
  bytes := overlay(bytes PLACING substring(int8send(millis) FROM 3) FROM 1 FOR 6);
  bytes := set_byte(bytes, 6, (get_byte(bytes, 6) & 15) | 112);
  RETURN encode(bytes, 'hex')::uuid;
END
$$;
