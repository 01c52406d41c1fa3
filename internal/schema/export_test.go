package schema

// MigrateTo is Migrate up to version upTo, for the upgrade test.
var MigrateTo = migrate
