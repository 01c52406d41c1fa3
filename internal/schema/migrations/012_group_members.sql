-- Which release each member of a group runs (issue 40). Processors of this release and later
-- write their Kafka member id here every 30 seconds; `upgrade finalize` takes a member of a group
-- (as the broker describes it) that is not here for one of the release before, and refuses to
-- close the upgrade window while any runs. An expand migration: the release before never reads it.
CREATE TABLE group_members (
    consumer_group text        NOT NULL,
    member_id      text        NOT NULL,
    release        text        NOT NULL,
    schema_version integer     NOT NULL,
    instance       text        NOT NULL,
    seen_at        timestamptz NOT NULL,
    PRIMARY KEY (consumer_group, member_id)
);
